// report.html: one self-contained page (the charting library and the data inlined, nothing
// fetched), so that a profile can be mailed, archived and opened offline. See
// docs/notes/report.md for the page's layout and the test hooks (data-rendered, data-errors).
#include <fmt/format.h>

#include <cctype>
#include <fstream>
#include <iterator>
#include <sstream>

#include "report/profile.h"

#ifndef HEADROOM_SOURCE_DIR
#define HEADROOM_SOURCE_DIR "."
#endif

namespace headroom::report {

namespace {

// The page. The markers TITLE, CHARTLIB and DATA between @@ are filled by render(); the rest is
// literal (no format braces: the CSS and JavaScript are full of them).
constexpr const char* kTemplate = R"HTML(<!DOCTYPE html>
<html lang="en" data-errors="0">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>@@TITLE@@</title>
<script>
// Page errors land in data-errors and #errors, so a headless browser test can read them.
(function () {
  var errors = [];
  function record(msg) {
    errors.push(String(msg));
    document.documentElement.setAttribute('data-errors', String(errors.length));
    var el = document.getElementById('errors');
    if (el) { el.textContent = errors.join('\n'); el.hidden = false; }
  }
  window.addEventListener('error', function (e) {
    record((/^Uncaught/.test(e.message) ? '' : 'Uncaught ') + e.message + ' (' + e.filename + ':' + e.lineno + ')');
  });
  window.addEventListener('unhandledrejection', function (e) { record('Unhandled rejection: ' + e.reason); });
  var consoleError = console.error;
  console.error = function () {
    record('console.error: ' + Array.prototype.join.call(arguments, ' '));
    consoleError.apply(console, arguments);
  };
  window.hrRecordError = record;
})();
</script>
<style>
:root { --fg:#1d2330; --muted:#5f6b7a; --line:#e3e7ee; --bg:#f6f8fb; --card:#fff; --accent:#2563eb; --bad:#c2410c; }
* { box-sizing: border-box; }
body { margin:0; font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"Helvetica Neue",Arial,sans-serif; color:var(--fg); background:var(--bg); }
header { background:#101828; color:#fff; padding:18px 28px 16px; }
header h1 { margin:0 0 4px; font-size:22px; font-weight:600; }
header .meta { color:#c5cedb; font-size:13px; }
main { max-width:1240px; margin:0 auto; padding:18px 20px 40px; }
.kpis { display:grid; grid-template-columns:repeat(5,1fr); gap:12px; margin-bottom:14px; }
.kpi { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:10px 14px; }
.kpi .label { color:var(--muted); font-size:12px; text-transform:uppercase; letter-spacing:.04em; }
.kpi .value { font-size:22px; font-weight:600; margin-top:2px; }
.kpi .sub { color:var(--muted); font-size:12px; }
.summary { margin:0 0 16px; color:var(--fg); font-size:15px; }
.summary.over { color:var(--bad); }
section.card { background:var(--card); border:1px solid var(--line); border-radius:8px; padding:14px 18px 16px; margin-bottom:16px; }
section.card h2 { font-size:16px; margin:0 0 2px; font-weight:600; }
section.card p.note { margin:0 0 10px; color:var(--muted); font-size:12.5px; }
.grid2 { display:grid; grid-template-columns:1fr 1fr; gap:16px; }
.grid2 > section.card { margin-bottom:0; }
.row { margin-bottom:16px; }
.chart { position:relative; height:300px; }
.chart.tall { height:360px; }
.chart .empty { position:absolute; inset:0; display:flex; align-items:center; justify-content:center; color:var(--muted); }
table { border-collapse:collapse; width:100%; font-size:12.5px; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:4px 8px; border-bottom:1px solid var(--line); white-space:nowrap; }
th { color:var(--muted); font-weight:600; background:#fafbfd; position:sticky; top:0; }
td.num, th.num { text-align:right; }
tr.chosen td { background:#eef4ff; font-weight:600; }
tr.nofit td { color:var(--bad); }
.scroll { max-height:280px; overflow:auto; border:1px solid var(--line); border-radius:6px; }
.swatch { display:inline-block; width:10px; height:10px; border-radius:2px; margin-right:6px; vertical-align:-1px; }
#errors { background:#fff1f0; color:#a8071a; border:1px solid #ffccc7; padding:10px; white-space:pre-wrap; }
footer { color:var(--muted); font-size:12px; text-align:center; margin-top:8px; }
</style>
</head>
<body>
<header>
  <h1 id="title"></h1>
  <div class="meta" id="meta"></div>
</header>
<main>
<pre id="errors" hidden></pre>
<div class="kpis" id="kpis"></div>
<p class="summary" id="summary"></p>

<section class="card row">
  <h2>Memory timeline</h2>
  <p class="note" id="timeline-note"></p>
  <div class="chart tall" data-chart="timeline"><canvas></canvas></div>
</section>

<div class="grid2 row">
  <section class="card">
    <h2>At the peak, by category</h2>
    <p class="note" id="bycat-note"></p>
    <div class="scroll"><table id="bycat-table"></table></div>
  </section>
  <section class="card">
    <h2>Live at the peak</h2>
    <p class="note" id="live-note"></p>
    <div class="scroll"><table id="live-table"></table></div>
  </section>
</div>

<div class="grid2 row">
  <section class="card">
    <h2>Memory vs micro-batch</h2>
    <p class="note">Planned peak for each micro-batch size, measured where it ran; the dashed line is the budget.</p>
    <div class="chart" data-chart="sweep-memory"><canvas></canvas></div>
  </section>
  <section class="card">
    <h2>Throughput vs micro-batch</h2>
    <p class="note">Predicted by the cost model, measured where it ran.</p>
    <div class="chart" data-chart="sweep-throughput"><canvas></canvas></div>
  </section>
</div>

<section class="card row">
  <h2>Sweep</h2>
  <div class="scroll"><table id="sweep-table"></table></div>
</section>

<div class="grid2 row">
  <section class="card">
    <h2>Fragmentation</h2>
    <p class="note" id="frag-note"></p>
    <div class="chart" data-chart="fragmentation"><canvas></canvas></div>
  </section>
  <section class="card">
    <h2>Time per op category</h2>
    <p class="note" id="time-note"></p>
    <div class="chart" data-chart="time-by-category"><canvas></canvas></div>
  </section>
</div>

<section class="card row">
  <h2>The plan and its runners-up</h2>
  <p class="note" id="plan-note"></p>
  <div class="scroll"><table id="plan-table"></table></div>
</section>

<section class="card row" id="markers-card">
  <h2>Re-plans and out-of-memory recoveries</h2>
  <div class="scroll"><table id="markers-table"></table></div>
</section>
<footer>Written by headroom. Self-contained: works offline. The full event trace is trace.json (open it in Perfetto or chrome://tracing); the figures are in memory.json.</footer>
</main>
<script>
@@CHARTLIB@@
</script>
<script type="application/json" id="hr-data">@@DATA@@</script>
<script>
(function () {
  'use strict';
  var D = JSON.parse(document.getElementById('hr-data').textContent);
  var GiB = 1073741824, MiB = 1048576, KiB = 1024;

  function fmtBytes(b) {
    if (b === null || b === undefined) return '—';
    var a = Math.abs(b);
    if (a >= GiB) return (b / GiB).toFixed(a >= 100 * GiB ? 0 : 2) + ' GiB';
    if (a >= MiB) return (b / MiB).toFixed(a >= 100 * MiB ? 0 : 1) + ' MiB';
    if (a >= KiB) return (b / KiB).toFixed(1) + ' KiB';
    return b + ' B';
  }
  function fmtRate(r) {
    if (r === null || r === undefined) return '—';
    return Math.round(r).toLocaleString('en-US');
  }
  function fmtMs(ms) { return ms >= 100 ? Math.round(ms).toLocaleString('en-US') : ms >= 1 ? ms.toFixed(1) : ms.toFixed(3); }
  // One unit per chart, chosen from its largest value, and stated on the axis.
  function byteUnit(maxBytes) { return maxBytes >= GiB ? { div: GiB, name: 'GiB' } : maxBytes >= MiB ? { div: MiB, name: 'MiB' } : { div: KiB, name: 'KiB' }; }
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    if (attrs) for (var k in attrs) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function setText(id, text) { document.getElementById(id).textContent = text; }
  function fillTable(id, headers, rows, rowClass) {
    var t = document.getElementById(id);
    var thead = el('thead'), tr = el('tr');
    headers.forEach(function (h) { tr.appendChild(el('th', h.num ? { 'class': 'num' } : null, h.label)); });
    thead.appendChild(tr); t.appendChild(thead);
    var tb = el('tbody');
    rows.forEach(function (r, i) {
      var row = el('tr', rowClass ? { 'class': rowClass(i) } : null);
      r.forEach(function (c, j) {
        var td = el('td', headers[j].num ? { 'class': 'num' } : null);
        if (c instanceof Node) td.appendChild(c); else td.textContent = c;
        row.appendChild(td);
      });
      tb.appendChild(row);
    });
    t.appendChild(tb);
  }

  var PALETTE = {
    weights: '#4e79a7', grads: '#f28e2b', optimizer: '#59a14f', master: '#b07aa1',
    activations: '#e15759', recompute: '#ff9da7', workspace: '#9c755f', logits: '#edc948',
    comm: '#76b7b2', staging: '#86bcb6', offload: '#8cd17d', other: '#bab0ac'
  };
  var EXTRA = ['#1f77b4', '#ff7f0e', '#2ca02c', '#d62728', '#9467bd', '#8c564b', '#e377c2', '#7f7f7f', '#bcbd22', '#17becf'];
  var extraUsed = {};
  function color(cat) {
    if (PALETTE[cat]) return PALETTE[cat];
    if (!extraUsed[cat]) extraUsed[cat] = EXTRA[Object.keys(extraUsed).length % EXTRA.length];
    return extraUsed[cat];
  }
  function swatch(cat) { var s = el('span', { 'class': 'swatch' }); s.style.background = color(cat); return s; }
  function catCell(cat) { var f = document.createDocumentFragment(); f.appendChild(swatch(cat)); f.appendChild(document.createTextNode(cat)); return f; }

  Chart.defaults.font.family = getComputedStyle(document.body).fontFamily;
  Chart.defaults.font.size = 12;
  Chart.defaults.color = '#3b4656';
  Chart.defaults.animation = false;
  Chart.defaults.maintainAspectRatio = false;

  // Each chart's container gets data-rendered="1" after Chart.js has drawn it (the browser test
  // checks it), or "empty" with a note when there is nothing to draw.
  var renderedPlugin = {
    id: 'hrRendered',
    afterRender: function (chart) { chart.canvas.parentNode.setAttribute('data-rendered', '1'); }
  };
  function chartIn(name, config) {
    var box = document.querySelector('[data-chart="' + name + '"]');
    config.plugins = (config.plugins || []).concat([renderedPlugin]);
    try {
      return new Chart(box.querySelector('canvas'), config);
    } catch (e) {
      window.hrRecordError('chart ' + name + ': ' + (e && e.stack || e));
      return null;
    }
  }
  function emptyChart(name, why) {
    var box = document.querySelector('[data-chart="' + name + '"]');
    box.querySelector('canvas').remove();
    box.appendChild(el('div', { 'class': 'empty' }, why));
    box.setAttribute('data-rendered', 'empty');
  }
  function axisTitle(text) { return { display: true, text: text }; }

  // Header and summary.
  setText('title', D.title || 'headroom profile');
  document.title = D.title || 'headroom profile';
  setText('meta', [D.model, D.device, D.run].filter(Boolean).join('  ·  '));
  var kp = document.getElementById('kpis');
  function kpi(label, value, sub) {
    var k = el('div', { 'class': 'kpi' });
    k.appendChild(el('div', { 'class': 'label' }, label));
    k.appendChild(el('div', { 'class': 'value' }, value));
    k.appendChild(el('div', { 'class': 'sub' }, sub || ''));
    kp.appendChild(k);
  }
  var budget = D.budget_bytes || 0;
  kpi('Measured peak', fmtBytes(D.peak_bytes), budget ? (100 * D.peak_bytes / budget).toFixed(1) + '% of budget' : '');
  kpi('Planned peak', fmtBytes(D.planned_peak_bytes),
      D.planned_peak_bytes ? 'measured − planned: ' + fmtBytes(D.peak_bytes - D.planned_peak_bytes) : '');
  kpi('Budget', budget ? fmtBytes(budget) : 'unknown', budget ? 'headroom ' + fmtBytes(budget - D.peak_bytes) : '');
  kpi('Fragmentation', D.fragmentation === null ? '—' : D.fragmentation.toFixed(3) + '×', 'arena / lower bound');
  var ch = D.plan.chosen;
  kpi('Plan', ch.micro_batch ? ch.micro_batch + ' × ' + ch.accumulation : '—',
      ch.micro_batch ? 'micro-batch × accumulation, ' + (ch.precision || '') : '');
  var sum = document.getElementById('summary');
  var parts = ['Peak ' + fmtBytes(D.peak_bytes) + ' measured', fmtBytes(D.planned_peak_bytes) + ' planned'];
  if (budget) parts.push('budget ' + fmtBytes(budget));
  sum.textContent = parts.join(' vs ') + '.' + (D.planned_peak_bytes && D.peak_bytes === D.planned_peak_bytes ? ' Measured equals planned.' : '');
  if (budget && D.peak_bytes > budget) sum.className = 'summary over';

  // Memory timeline, stacked by category, with the peak and markers drawn as vertical lines.
  var T = D.timeline;
  if (!T || T.t_us.length === 0) {
    emptyChart('timeline', 'No memory samples in this profile.');
    setText('timeline-note', '');
  } else {
    // Times since the start of the run, as in trace.json; seconds for long windows.
    var tFirst = T.t_us[0], tLast = T.t_us[T.t_us.length - 1];
    var tu = tLast - tFirst >= 2e7 ? { div: 1e6, name: 's' } : { div: 1e3, name: 'ms' };
    var unit = byteUnit(T.peak ? T.peak.bytes : 0);
    var datasets = [];
    T.categories.forEach(function (cat, i) {
      var ys = T.bytes[i];
      if (!ys.some(function (v) { return v > 0; })) return;  // a category never used
      var pts = new Array(ys.length);
      for (var j = 0; j < ys.length; ++j) pts[j] = { x: T.t_us[j] / tu.div, y: ys[j] / unit.div };
      datasets.push({
        label: cat, data: pts, stepped: 'before', fill: datasets.length === 0 ? 'origin' : '-1',
        borderColor: color(cat), backgroundColor: color(cat) + 'cc', borderWidth: 0.5,
        pointRadius: 0, pointHitRadius: 0
      });
    });
    var vlines = [];
    if (T.peak) vlines.push({ x: T.peak.t_us / tu.div, color: '#111', label: 'peak ' + fmtBytes(T.peak.bytes) });
    (T.markers || []).forEach(function (m) { vlines.push({ x: m.t_us / tu.div, color: '#c2410c', label: m.name }); });
    var vlinePlugin = {
      id: 'hrVlines',
      afterDatasetsDraw: function (chart) {
        var c = chart.ctx, xs = chart.scales.x, area = chart.chartArea;
        var rowEnds = [];  // right edge of the last label in each row: labels that would overlap go lower
        vlines.map(function (v) { return { v: v, px: xs.getPixelForValue(v.x) }; })
          .sort(function (a, b) { return a.px - b.px; })
          .forEach(function (it) {
            var v = it.v, px = it.px;
            if (px < area.left - 1 || px > area.right + 1) return;
            c.save();
            c.strokeStyle = v.color; c.lineWidth = 1.5; c.setLineDash([5, 4]);
            c.beginPath(); c.moveTo(px, area.top); c.lineTo(px, area.bottom); c.stroke();
            c.setLineDash([]); c.font = '600 12px ' + Chart.defaults.font.family;
            var w = c.measureText(v.label).width;
            var lx = px + 5 + w > area.right ? px - 5 - w : px + 5;
            var row = 0;
            while (row < rowEnds.length && rowEnds[row] > lx - 4) ++row;
            rowEnds[row] = lx + w;
            var ty = area.top + 2 + 18 * row;
            c.fillStyle = 'rgba(255,255,255,0.85)'; c.fillRect(lx - 2, ty, w + 4, 16);
            c.fillStyle = v.color; c.fillText(v.label, lx, ty + 12);
            c.restore();
          });
      }
    };
    var budgetLine = budget && budget <= 1.6 * (T.peak ? T.peak.bytes : 0) ? budget / unit.div : null;
    if (budgetLine !== null) {
      datasets.push({ label: 'budget', data: [{ x: tFirst / tu.div, y: budgetLine }, { x: tLast / tu.div, y: budgetLine }],
        borderColor: '#c2410c', borderDash: [6, 4], borderWidth: 1.5, pointRadius: 0, fill: false, stack: 'budget' });
    }
    chartIn('timeline', {
      type: 'line', data: { datasets: datasets },
      options: {
        parsing: false, normalized: true, spanGaps: true,
        interaction: { mode: 'nearest', axis: 'x', intersect: false },
        scales: {
          x: { type: 'linear', title: axisTitle('time since the start of the run (' + tu.name + ')'), min: tFirst / tu.div, max: tLast / tu.div,
            ticks: { includeBounds: false } },
          y: { stacked: true, beginAtZero: true, title: axisTitle('device memory (' + unit.name + ')') }
        },
        plugins: {
          legend: { position: 'right', labels: { boxWidth: 12 } },
          tooltip: { callbacks: { label: function (ctx) { return ctx.dataset.label + ': ' + fmtBytes(ctx.parsed.y * unit.div); } } },
          decimation: { enabled: false }
        }
      },
      plugins: [vlinePlugin]
    });
    var fmtT = function (us) { return tu.name === 's' ? (us / 1e6).toFixed(1) : fmtMs(us / 1e3); };
    var note = 'Device bytes in use, stacked by category, from ' + fmtT(tFirst) + ' to ' + fmtT(tLast) + ' ' + tu.name +
      (D.counts.memory_samples > T.total_samples ? ' (one step of the run)' : '') + '.';
    if (T.total_samples > T.t_us.length) note += ' Downsampled from ' + T.total_samples.toLocaleString('en-US') + ' to ' + T.t_us.length.toLocaleString('en-US') + ' samples, keeping each bucket\'s highest and lowest (the peak is exact).';
    setText('timeline-note', note);
  }

  // By category at the peak: measured (from the timeline) and planned.
  var measured = D.timeline_peak ? D.timeline_peak.by_category : {};
  var planned = D.planned_by_category || {};
  var cats = Object.keys(measured);
  Object.keys(planned).forEach(function (c) { if (cats.indexOf(c) < 0) cats.push(c); });
  cats = cats.filter(function (c) { return (measured[c] || 0) + (planned[c] || 0) > 0; });
  cats.sort(function (a, b) { return ((measured[b] || planned[b] || 0) - (measured[a] || planned[a] || 0)); });
  var peakTotal = D.timeline_peak ? D.timeline_peak.bytes : 0;
  fillTable('bycat-table', [{ label: 'category' }, { label: 'measured at peak', num: true }, { label: 'share', num: true }, { label: 'planned', num: true }],
    cats.map(function (c) {
      return [catCell(c), fmtBytes(measured[c] === undefined ? null : measured[c]),
        peakTotal && measured[c] !== undefined ? (100 * measured[c] / peakTotal).toFixed(1) + '%' : '—',
        fmtBytes(planned[c] === undefined ? null : planned[c])];
    }));
  setText('bycat-note', D.timeline_peak ? 'Timeline peak ' + fmtBytes(peakTotal) + ' at ' + fmtMs(D.timeline_peak.t_us / 1000) + ' ms.' : 'No timeline.');

  var live = (D.live_at_peak || []).slice().sort(function (a, b) { return b.bytes - a.bytes; });
  var shown = live.slice(0, 200);
  fillTable('live-table', [{ label: 'buffer' }, { label: 'category' }, { label: 'bytes', num: true }, { label: 'offset', num: true }],
    shown.map(function (b) { return [b.name, catCell(b.category), fmtBytes(b.bytes), b.offset.toLocaleString('en-US')]; }));
  var liveTotal = live.reduce(function (s, b) { return s + b.bytes; }, 0);
  setText('live-note', live.length + ' buffers, ' + fmtBytes(liveTotal) + (live.length > shown.length ? '; the largest ' + shown.length + ' shown (all in memory.json).' : '; largest first.'));

  // Sweep: memory and throughput versus micro-batch.
  var S = D.sweep || [];
  if (S.length === 0) {
    emptyChart('sweep-memory', 'No sweep in this profile.');
    emptyChart('sweep-throughput', 'No sweep in this profile.');
  } else {
    var labels = S.map(function (r) { return String(r.micro_batch); });
    var maxB = Math.max.apply(null, S.map(function (r) { return Math.max(r.planned_peak_bytes, r.measured_peak_bytes || 0); }));
    var su = byteUnit(Math.max(maxB, budget));
    var memSets = [
      { label: 'planned peak', data: S.map(function (r) { return r.planned_peak_bytes / su.div; }), borderColor: '#2563eb', backgroundColor: '#2563eb',
        pointBackgroundColor: S.map(function (r) { return r.fits ? '#2563eb' : '#c2410c'; }), pointRadius: 4, borderWidth: 2 },
      { label: 'measured peak', data: S.map(function (r) { return r.measured_peak_bytes === null ? null : r.measured_peak_bytes / su.div; }),
        borderColor: '#16a34a', backgroundColor: '#16a34a', pointRadius: 6, pointStyle: 'rectRot', showLine: false }
    ];
    if (budget) memSets.push({ label: 'budget', data: S.map(function () { return budget / su.div; }), borderColor: '#c2410c', borderDash: [6, 4], borderWidth: 1.5, pointRadius: 0 });
    chartIn('sweep-memory', {
      type: 'line', data: { labels: labels, datasets: memSets },
      options: {
        interaction: { mode: 'index', intersect: false },
        scales: { x: { title: axisTitle('micro-batch (sequences)') }, y: { beginAtZero: true, title: axisTitle('peak memory (' + su.name + ')') } },
        plugins: { tooltip: { callbacks: { label: function (c) { return c.dataset.label + ': ' + (c.parsed.y === null ? '—' : fmtBytes(c.parsed.y * su.div)); } } } }
      }
    });
    chartIn('sweep-throughput', {
      type: 'line',
      data: { labels: labels, datasets: [
        { label: 'predicted', data: S.map(function (r) { return r.predicted_tokens_per_s; }), borderColor: '#7c3aed', backgroundColor: '#7c3aed', pointRadius: 4, borderWidth: 2 },
        { label: 'measured', data: S.map(function (r) { return r.measured_tokens_per_s; }), borderColor: '#16a34a', backgroundColor: '#16a34a', pointRadius: 6, pointStyle: 'rectRot', showLine: false }
      ] },
      options: {
        interaction: { mode: 'index', intersect: false },
        scales: { x: { title: axisTitle('micro-batch (sequences)') }, y: { beginAtZero: true, title: axisTitle('throughput (tokens/s)') } },
        plugins: { tooltip: { callbacks: { label: function (c) { return c.dataset.label + ': ' + fmtRate(c.parsed.y) + ' tokens/s'; } } } }
      }
    });
  }
  fillTable('sweep-table', [{ label: 'micro-batch', num: true }, { label: 'planned peak', num: true }, { label: 'measured peak', num: true },
    { label: 'predicted tokens/s', num: true }, { label: 'measured tokens/s', num: true }, { label: 'fits' }],
    S.map(function (r) { return [r.micro_batch, fmtBytes(r.planned_peak_bytes), fmtBytes(r.measured_peak_bytes), fmtRate(r.predicted_tokens_per_s), fmtRate(r.measured_tokens_per_s), r.fits ? 'yes' : 'no']; }),
    function (i) { return (S[i].micro_batch === ch.micro_batch ? 'chosen' : '') + (S[i].fits ? '' : ' nofit'); });

  // Fragmentation: what the arena holds against what no allocator could beat.
  var fr = [['lower bound', D.lower_bound_bytes, '#94a3b8'], ['arena (plan)', D.arena_bytes, '#2563eb'],
    ['measured peak', D.peak_bytes, '#16a34a'], ['budget', budget, '#c2410c']].filter(function (r) { return r[1] > 0; });
  if (fr.length === 0) {
    emptyChart('fragmentation', 'No arena figures in this profile.');
  } else {
    var fu = byteUnit(Math.max.apply(null, fr.map(function (r) { return r[1]; })));
    chartIn('fragmentation', {
      type: 'bar',
      data: { labels: fr.map(function (r) { return r[0]; }), datasets: [{ label: 'bytes', data: fr.map(function (r) { return r[1] / fu.div; }), backgroundColor: fr.map(function (r) { return r[2]; }) }] },
      options: {
        indexAxis: 'y', scales: { x: { beginAtZero: true, title: axisTitle(fu.name) } },
        plugins: { legend: { display: false }, tooltip: { callbacks: { label: function (c) { return fmtBytes(c.parsed.x * fu.div); } } } }
      }
    });
  }
  setText('frag-note', D.fragmentation === null ? 'No lower bound recorded.' :
    'Arena ' + fmtBytes(D.arena_bytes) + ' over a lower bound of ' + fmtBytes(D.lower_bound_bytes) + ': ' + D.fragmentation.toFixed(3) + '× (' +
    ((D.fragmentation - 1) * 100).toFixed(1) + '% above the most bytes ever live at once).');

  // Time per op category.
  var tb = Object.keys(D.time_by_category_ms).map(function (k) { return [k, D.time_by_category_ms[k]]; })
    .sort(function (a, b) { return b[1] - a[1]; });
  if (tb.length === 0) {
    emptyChart('time-by-category', 'No op spans in this profile.');
    setText('time-note', '');
  } else {
    var totalMs = tb.reduce(function (s, r) { return s + r[1]; }, 0);
    chartIn('time-by-category', {
      type: 'bar',
      data: { labels: tb.map(function (r) { return r[0]; }), datasets: [{ label: 'time (ms)', data: tb.map(function (r) { return r[1]; }), backgroundColor: '#6366f1' }] },
      options: {
        indexAxis: 'y', scales: { x: { beginAtZero: true, title: axisTitle('time (ms), summed over threads') } },
        plugins: { legend: { display: false }, tooltip: { callbacks: { label: function (c) { return fmtMs(c.parsed.x) + ' ms (' + (100 * c.parsed.x / totalMs).toFixed(1) + '%)'; } } } }
      }
    });
    setText('time-note', fmtMs(totalMs) + ' ms of op time in ' + D.counts.spans.toLocaleString('en-US') + ' spans; ' + tb[0][0] + ' leads with ' + (100 * tb[0][1] / totalMs).toFixed(1) + '%.');
  }

  // The plan and its runners-up.
  var rows = [D.plan.chosen].concat(D.plan.runners_up || []).filter(function (c) { return c.micro_batch > 0; });
  fillTable('plan-table', [{ label: '' }, { label: 'micro-batch', num: true }, { label: 'accumulation', num: true }, { label: 'precision' }, { label: 'techniques' },
    { label: 'planned peak', num: true }, { label: 'lower bound', num: true }, { label: 'predicted tokens/s', num: true }, { label: 'vs chosen', num: true }],
    rows.map(function (c, i) {
      return [i === 0 ? 'chosen' : '#' + (i + 1), c.micro_batch, c.accumulation, c.precision, c.techniques, fmtBytes(c.peak_bytes), fmtBytes(c.lower_bound_bytes),
        fmtRate(c.predicted_tokens_per_s), rows[0].predicted_tokens_per_s ? (100 * c.predicted_tokens_per_s / rows[0].predicted_tokens_per_s).toFixed(1) + '%' : '—'];
    }), function (i) { return i === 0 ? 'chosen' : ''; });
  setText('plan-note', rows.length ? 'Fastest configuration that fits first; planning took ' + fmtMs(D.plan.planning_ms) + ' ms.' : 'No plan recorded.');

  var M = D.markers || [];
  if (M.length === 0) {
    document.getElementById('markers-card').hidden = true;
  } else {
    fillTable('markers-table', [{ label: 'time (ms)', num: true }, { label: 'event' }, { label: 'detail' }],
      M.map(function (m) { return [fmtMs(m.t_us / 1000), m.name, m.detail]; }));
  }
  document.documentElement.setAttribute('data-complete', '1');
})();
</script>
</body>
</html>
)HTML";

// Fills the template's @@KEY@@ markers in one pass, so that a value containing a marker's text
// (a title, the library) is never substituted again.
std::string render(const std::string& tmpl,
                   const std::map<std::string, const std::string*>& values) {
  std::string out;
  size_t at = 0;
  while (true) {
    const size_t open = tmpl.find("@@", at);
    const size_t close = open == std::string::npos ? open : tmpl.find("@@", open + 2);
    if (close == std::string::npos) break;
    auto it = values.find(tmpl.substr(open + 2, close - open - 2));
    if (it == values.end()) {  // not a marker: keep the text
      out.append(tmpl, at, open + 2 - at);
      at = open + 2;
      continue;
    }
    out.append(tmpl, at, open - at);
    out += *it->second;
    at = close + 2;
  }
  out.append(tmpl, at, std::string::npos);
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// The library as it may sit inside <script>: no source-map comment (it would make DevTools look
// for a file next to report.html) and no "</script" that would close the element early.
std::string script_safe(std::string js) {
  for (size_t at = js.find("//# sourceMappingURL="); at != std::string::npos;
       at = js.find("//# sourceMappingURL=", at)) {
    const size_t end = js.find('\n', at);
    js.erase(at, end == std::string::npos ? std::string::npos : end - at);
  }
  for (size_t at = js.find("</"); at != std::string::npos; at = js.find("</", at + 2)) {
    std::string word = js.substr(at + 2, 6);
    for (char& c : word) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (word == "script") js.replace(at, 2, "<\\/");
  }
  return js;
}

// The timeline that the page draws: the window's samples, downsampled, as columns.
std::string timeline_json(const Profile& p) {
  std::vector<std::string> categories;
  std::vector<MemorySample> derived;
  const auto& all = detail::resolve_timeline(p, &categories, &derived);
  size_t lo = 0, hi = all.size();
  if (p.window_end_us > p.window_start_us) {
    while (lo < hi && all[lo].t_us < p.window_start_us) ++lo;
    size_t h = lo;
    while (h < hi && all[h].t_us < p.window_end_us) ++h;
    hi = h;
  }
  std::vector<double> totals;
  totals.reserve(hi - lo);
  for (size_t i = lo; i < hi; ++i)
    totals.push_back(static_cast<double>(detail::sample_total(all[i])));
  const std::vector<size_t> keep = downsample_indices(totals, kMaxTimelinePoints);

  std::string out = "{\"categories\":[";
  for (size_t c = 0; c < categories.size(); ++c) {
    if (c) out.push_back(',');
    detail::append_json_string(out, categories[c]);
  }
  out += "],\"t_us\":[";
  for (size_t k = 0; k < keep.size(); ++k) {
    if (k) out.push_back(',');
    detail::append_json_number(out, all[lo + keep[k]].t_us);
  }
  out += "],\"bytes\":[";
  for (size_t c = 0; c < categories.size(); ++c) {
    out += c ? ",[" : "[";
    for (size_t k = 0; k < keep.size(); ++k) {
      if (k) out.push_back(',');
      const auto& b = all[lo + keep[k]].bytes;
      fmt::format_to(std::back_inserter(out), "{}", c < b.size() ? b[c] : 0);
    }
    out.push_back(']');
  }
  fmt::format_to(std::back_inserter(out), "],\"total_samples\":{}", hi - lo);
  out += ",\"peak\":";
  if (!totals.empty()) {
    size_t best = 0;
    for (size_t i = 1; i < totals.size(); ++i) {
      if (totals[i] > totals[best]) best = i;
    }
    out += "{\"t_us\":";
    detail::append_json_number(out, all[lo + best].t_us);
    fmt::format_to(std::back_inserter(out), ",\"bytes\":{}}}",
                   detail::sample_total(all[lo + best]));
  } else {
    out += "null";
  }
  // Markers inside the drawn window, for vertical lines on the timeline.
  out += ",\"markers\":[";
  bool first = true;
  const double t_lo = hi > lo ? all[lo].t_us : 0, t_hi = hi > lo ? all[hi - 1].t_us : 0;
  for (const Marker& m : p.markers) {
    if (hi == lo || m.t_us < t_lo || m.t_us > t_hi) continue;
    out += first ? "{\"t_us\":" : ",{\"t_us\":";
    first = false;
    detail::append_json_number(out, m.t_us);
    out += ",\"name\":";
    detail::append_json_string(out, m.name);
    out += "}";
  }
  out += "]}";
  return out;
}

}  // namespace

std::string default_chart_lib_path() {
  return std::string(HEADROOM_SOURCE_DIR) +
         "/third_party/chartlib/node_modules/chart.js/dist/chart.umd.min.js";
}

Result<ChartLib> load_chart_lib(const std::string& js_path) {
  std::ifstream in(js_path, std::ios::binary);
  if (!in) {
    return Status::not_found(
        fmt::format("the charting library for report.html is missing: '{}' does not exist; run "
                    "scripts/get-chart-lib",
                    js_path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) return Status::io_error(fmt::format("cannot read '{}'", js_path));
  ChartLib lib;
  lib.js = text.str();
  if (lib.js.find("Chart") == std::string::npos) {
    return Status::corrupt(fmt::format(
        "'{}' does not look like Chart.js (no 'Chart' in it); run scripts/get-chart-lib", js_path));
  }
  return lib;
}

Status write_html_report(const Profile& profile, const std::string& path,
                         const std::string& chart_lib_js) {
  if (chart_lib_js.empty()) {
    return Status::invalid_argument(fmt::format(
        "cannot write '{}': no charting library given; run scripts/get-chart-lib", path));
  }
  std::string data = detail::figures_json(profile);
  data.pop_back();  // the closing brace: the timeline joins the same object
  data += ",\"timeline\":";
  data += timeline_json(profile);
  data.push_back('}');

  const std::string title = html_escape(profile.title);
  const std::string lib = script_safe(chart_lib_js);
  std::string page = render(kTemplate, {{"TITLE", &title}, {"DATA", &data}, {"CHARTLIB", &lib}});

  detail::AtomicFileWriter file(path);
  HR_RETURN_IF_ERROR(file.open());
  file.write(page);
  return file.commit();
}

}  // namespace headroom::report
