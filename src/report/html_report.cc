// report.html: one self-contained page (the charting library and the data inlined, nothing
// fetched), so that a profile can be mailed, archived and opened offline. See
// docs/notes/report.md for the page's layout and the test hooks (data-rendered, data-errors).
#include <fmt/format.h>

#include <bit>
#include <cctype>
#include <fstream>
#include <iterator>
#include <sstream>

#include "core/utf8.h"
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
.chart.overview { height:110px; margin-bottom:8px; cursor:crosshair; }
.chart[data-chart="timeline"] { cursor:crosshair; }
button.reset { float:right; font:12px system-ui,sans-serif; padding:2px 10px; border:1px solid var(--line); border-radius:5px; background:#fff; color:var(--fg); cursor:pointer; }
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
  <h2>Memory timeline <button type="button" id="timeline-reset" class="reset">Reset zoom</button></h2>
  <p class="note" id="timeline-note"></p>
  <div class="chart overview" data-chart="timeline-overview"><canvas></canvas></div>
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
  var dataEl = document.getElementById('hr-data');
  var D = JSON.parse(dataEl.textContent);
  // The parsed copy is all the page needs: drop the text (megabytes for a large run) from the DOM.
  dataEl.textContent = '';
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
    comm: '#76b7b2', staging: '#86bcb6', offload: '#8cd17d', kv_cache: '#d4a6c8', other: '#bab0ac'
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

  // Memory timeline: an overview of the whole run (total bytes, downsampled) and the detail chart
  // (stacked by category; first the window the profile names, typically one step). Dragging across
  // either chart zooms the detail chart into that range, drawn from the full-resolution changes
  // (T.full) with the lowest and highest moment of each pixel bucket kept, or every moment when
  // few enough; double-click or "Reset zoom" returns to the first window. window.hrZoom(a, b)
  // (microseconds) and report.html#zoom=a,b do the same (the browser test uses them).
  var T = D.timeline;
  if (!T || T.t_us.length === 0) {
    emptyChart('timeline', 'No memory samples in this profile.');
    emptyChart('timeline-overview', 'No memory samples in this profile.');
    setText('timeline-note', '');
  } else {
    var O = T.overview;
    var tFirst = T.t_us[0], tLast = T.t_us[T.t_us.length - 1];
    var runFirst = O.t_us[0], runLast = O.t_us[O.t_us.length - 1];
    // Times since the start of the run, as in trace.json; seconds for long runs.
    var tu = runLast - runFirst >= 2e7 ? { div: 1e6, name: 's' } : { div: 1e3, name: 'ms' };
    var runPeak = O.total.reduce(function (m, v) { return v > m ? v : m; }, 0);
    var P = T.pool;
    if (P) runPeak = P.device.reduce(function (m, v) { return v > m ? v : m; }, runPeak);
    var unit = byteUnit(Math.max(runPeak, T.peak ? T.peak.bytes : 0));
    var fmtT = function (us) { return tu.name === 's' ? (us / 1e6).toFixed(3) : fmtMs(us / 1e3); };
    // The categories drawn: any with bytes in the window or a change anywhere in the run.
    var used = [];
    T.categories.forEach(function (cat, i) {
      if (T.bytes[i].some(function (v) { return v > 0; }) || (T.full && T.full.dict_cat.indexOf(i) >= 0)) used.push(i);
    });
    var datasets = used.map(function (ci, k) {
      var cat = T.categories[ci];
      return {
        label: cat, data: [], stepped: 'after', fill: k === 0 ? 'origin' : '-1',
        borderColor: color(cat), backgroundColor: color(cat) + 'cc', borderWidth: 0.5,
        pointRadius: 0, pointHitRadius: 0
      };
    });
    // Fills the category datasets from sample times and a column (array) per category.
    function setSeries(ts, col) {
      used.forEach(function (ci, k) {
        var ys = col(ci), pts = new Array(ts.length);
        for (var j = 0; j < ts.length; ++j) pts[j] = { x: ts[j] / tu.div, y: ys[j] / unit.div };
        datasets[k].data = pts;
      });
    }
    setSeries(T.t_us, function (ci) { return T.bytes[ci]; });
    var vlines = [];
    if (T.peak) vlines.push({ x: T.peak.t_us / tu.div, color: '#111', label: 'peak ' + fmtBytes(T.peak.bytes) });
    (T.markers || []).forEach(function (m) { vlines.push({ x: m.t_us / tu.div, color: '#c2410c', label: m.name + (m.cause ? ' (' + m.cause + ')' : '') }); });
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
    // The rectangle being dragged (chart.$hrSel, in pixels) and, on the overview, the detail window.
    var view = { a: tFirst, b: tLast };
    var selPlugin = {
      id: 'hrSel',
      afterDatasetsDraw: function (chart) {
        var c = chart.ctx, area = chart.chartArea, xs = chart.scales.x;
        c.save();
        if (chart.$hrOverview) {
          var pa = Math.max(area.left, xs.getPixelForValue(view.a / tu.div)), pb = Math.min(area.right, xs.getPixelForValue(view.b / tu.div));
          c.fillStyle = 'rgba(37,99,235,0.12)'; c.fillRect(pa, area.top, Math.max(1, pb - pa), area.bottom - area.top);
          c.strokeStyle = '#2563eb'; c.lineWidth = 1; c.strokeRect(pa, area.top, Math.max(1, pb - pa), area.bottom - area.top);
        }
        var s = chart.$hrSel;
        if (s) { c.fillStyle = 'rgba(234,88,12,0.18)'; c.fillRect(Math.min(s.x0, s.x1), area.top, Math.abs(s.x1 - s.x0), area.bottom - area.top); }
        c.restore();
      }
    };
    var budgetLine = budget && budget <= 1.6 * runPeak ? budget / unit.div : null;
    var budgetSet = null;
    if (budgetLine !== null) {
      budgetSet = { label: 'budget', data: [{ x: tFirst / tu.div, y: budgetLine }, { x: tLast / tu.div, y: budgetLine }],
        borderColor: '#c2410c', borderDash: [6, 4], borderWidth: 1.5, pointRadius: 0, fill: false, stack: 'budget' };
      datasets.push(budgetSet);
    }
    if (P && P.t_us.length) {
      // What the device holds: buffers outside the pool plus the pool's reserved bytes (a line,
      // not a stacked category: the planned buffers inside the pool's block are in the stack).
      var devPts = new Array(P.t_us.length);
      for (var pi = 0; pi < P.t_us.length; ++pi) devPts[pi] = { x: P.t_us[pi] / tu.div, y: P.device[pi] / unit.div };
      datasets.push({ label: 'device reserved', data: devPts, stepped: 'after', borderColor: '#111827', borderDash: [2, 3],
        borderWidth: 1.5, pointRadius: 0, pointHitRadius: 0, fill: false, stack: 'reserved' });
    }
    var box = document.querySelector('[data-chart="timeline"]');
    var detailChart = chartIn('timeline', {
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
      plugins: [vlinePlugin, selPlugin]
    });
    var ovPts = new Array(O.t_us.length);
    for (var oi = 0; oi < O.t_us.length; ++oi) ovPts[oi] = { x: O.t_us[oi] / tu.div, y: O.total[oi] / unit.div };
    var overviewChart = chartIn('timeline-overview', {
      type: 'line',
      data: { datasets: [{ label: 'total', data: ovPts, stepped: 'after', fill: 'origin', borderColor: '#1d4ed8', backgroundColor: '#2563eb40',
        borderWidth: 1, pointRadius: 0, pointHitRadius: 0 }] },
      options: {
        parsing: false, normalized: true,
        interaction: { mode: 'nearest', axis: 'x', intersect: false },
        scales: {
          x: { type: 'linear', min: runFirst / tu.div, max: runLast / tu.div, ticks: { includeBounds: false } },
          y: { beginAtZero: true, ticks: { maxTicksLimit: 3 }, title: axisTitle(unit.name) }
        },
        plugins: {
          legend: { display: false }, decimation: { enabled: false },
          tooltip: { callbacks: { label: function (ctx) { return 'total: ' + fmtBytes(ctx.parsed.y * unit.div); } } }
        }
      },
      plugins: [selPlugin]
    });
    if (overviewChart) overviewChart.$hrOverview = true;

    // Full-resolution changes, decoded on the first zoom: t (float64, microseconds) and id (into
    // the (category, delta) dictionary), with the bytes of every category every 4096 changes.
    var FULL;
    function bytesOf(s) {
      var bin = atob(s), n = bin.length, u = new Uint8Array(n);
      for (var i = 0; i < n; ++i) u[i] = bin.charCodeAt(i);
      return u;
    }
    function full() {
      if (FULL !== undefined) return FULL;
      FULL = null;
      var F = T.full;
      if (!F || !F.n) return FULL;
      var n = F.n, C = T.categories.length, S = 4096;
      var t = new Float64Array(bytesOf(F.t).buffer, 0, n);
      var ib = bytesOf(F.id).buffer;
      var id = F.width === 2 ? new Uint16Array(ib, 0, n) : new Uint32Array(ib, 0, n);
      var dc = Int32Array.from(F.dict_cat), dd = Float64Array.from(F.dict_delta);
      var snap = new Float64Array((Math.floor(n / S) + 1) * C), cur = new Float64Array(C);
      for (var k = 0; k < n; ++k) {
        if (k % S === 0) snap.set(cur, (k / S) * C);
        cur[dc[id[k]]] += dd[id[k]];
      }
      FULL = { t: t, id: id, n: n, C: C, S: S, snap: snap, dc: dc, dd: dd };
      return FULL;
    }
    function upperBound(t, n, x) {
      var lo = 0, hi = n;
      while (lo < hi) { var m = (lo + hi) >> 1; if (t[m] <= x) lo = m + 1; else hi = m; }
      return lo;
    }
    // The samples of [a, b]: the bytes at a, then after each moment (the changes at one time) in
    // (a, b], and at b. Past 4 * buckets changes, each of `buckets` equal time buckets keeps its
    // lowest and highest moment (so the peak of the range is drawn exactly).
    function detail(a, b, buckets) {
      var F = full();
      if (!F) return null;
      var C = F.C, t = F.t, id = F.id, dc = F.dc, dd = F.dd;
      var i0 = upperBound(t, F.n, a), i1 = upperBound(t, F.n, b);
      var s0 = Math.floor(i0 / F.S), cur = F.snap.slice(s0 * C, s0 * C + C);
      for (var k = s0 * F.S; k < i0; ++k) cur[dc[id[k]]] += dd[id[k]];
      var total = 0;
      for (var c = 0; c < C; ++c) total += cur[c];
      var ts = [a], rows = [cur.slice()], moments = 0;
      var exact = i1 - i0 <= 4 * buckets;
      var w = (b - a) / buckets, bucket = -1, lo = null, hi = null;
      function flush() {
        if (!lo) return;
        if (lo.t === hi.t) { ts.push(lo.t); rows.push(lo.row); return; }
        var first = lo.t < hi.t ? lo : hi, second = lo.t < hi.t ? hi : lo;
        ts.push(first.t); rows.push(first.row); ts.push(second.t); rows.push(second.row);
      }
      k = i0;
      while (k < i1) {
        var tk = t[k];
        for (; k < i1 && t[k] === tk; ++k) { cur[dc[id[k]]] += dd[id[k]]; total += dd[id[k]]; }
        ++moments;
        if (exact) { ts.push(tk); rows.push(cur.slice()); continue; }
        var bk = Math.min(buckets - 1, Math.floor((tk - a) / w));
        if (bk !== bucket) {
          flush();
          bucket = bk;
          lo = { t: tk, v: total, row: cur.slice() };
          hi = lo;
        } else if (total < lo.v) {
          lo = { t: tk, v: total, row: cur.slice() };
        } else if (total > hi.v) {
          hi = { t: tk, v: total, row: cur.slice() };
        }
      }
      flush();
      ts.push(b); rows.push(cur.slice());
      return { ts: ts, rows: rows, moments: moments, exact: exact };
    }
    var firstNote = 'Device bytes in use, stacked by category, from ' + fmtT(tFirst) + ' to ' + fmtT(tLast) + ' ' + tu.name +
      (D.counts.memory_samples > T.total_samples ? ' (one step of the run)' : '') + '.';
    if (T.total_samples > T.t_us.length) firstNote += ' Downsampled from ' + T.total_samples.toLocaleString('en-US') + ' to ' + T.t_us.length.toLocaleString('en-US') + ' samples, keeping each bucket\'s highest and lowest (the peak is exact).';
    firstNote += T.full ? ' Drag across a chart to zoom in (full resolution); double-click to reset.' : ' Drag across a chart to zoom in.';
    function show(a, b, first) {
      var t0 = performance.now(), d = first ? null : detail(a, b, 1000);
      if (first) {
        setSeries(T.t_us, function (ci) { return T.bytes[ci]; });
      } else if (d) {
        setSeries(d.ts, function (ci) { return d.rows.map(function (r) { return r[ci]; }); });
      }
      view = { a: a, b: b };
      if (!detailChart) return;
      detailChart.options.scales.x.min = a / tu.div;
      detailChart.options.scales.x.max = b / tu.div;
      if (budgetSet) budgetSet.data = [{ x: a / tu.div, y: budgetLine }, { x: b / tu.div, y: budgetLine }];
      detailChart.update('none');
      if (overviewChart) overviewChart.draw();
      var points = datasets.length ? datasets[0].data.length : 0;
      box.setAttribute('data-window', a + ',' + b);
      box.setAttribute('data-points', String(points));
      box.setAttribute('data-resolution', first ? (T.total_samples > T.t_us.length ? 'downsampled' : 'full') : d ? (d.exact ? 'full' : 'downsampled') : 'overview');
      if (d) box.setAttribute('data-moments', String(d.moments));
      box.setAttribute('data-zoom-ms', (performance.now() - t0).toFixed(1));
      if (first) { setText('timeline-note', firstNote); return; }
      // Enough decimals to tell the ends of a narrow range apart.
      var dec = Math.min(6, Math.max(0, Math.ceil(-Math.log10((b - a) / tu.div)) + 2));
      setText('timeline-note', 'Zoomed to ' + (a / tu.div).toFixed(dec) + '–' + (b / tu.div).toFixed(dec) + ' ' + tu.name + ': ' +
        (d ? d.moments.toLocaleString('en-US') + ' moments, ' + (d.exact ? 'every one drawn.' : 'the highest and lowest of each of 1,000 buckets drawn.')
           : 'no full-resolution data in this page (too many events); the downsampled samples are shown.') + ' Double-click to reset.');
    }
    function zoom(a, b) {
      // Without full-resolution data only the window's samples exist: stay inside it.
      if (!T.full) { a = Math.max(a, tFirst); b = Math.min(b, tLast); }
      if (!(b > a)) return null;
      show(a, b, false);
      return Number(box.getAttribute('data-points'));
    }
    function reset() { show(tFirst, tLast, true); }
    window.hrZoom = zoom;
    window.hrResetZoom = reset;
    // Drag to select a range (in the chart's x pixels); a click without a drag does nothing.
    function dragSelect(chart) {
      if (!chart) return;
      var canvas = chart.canvas, active = false;
      function px(ev) { return ev.clientX - canvas.getBoundingClientRect().left; }
      canvas.addEventListener('mousedown', function (ev) { active = true; chart.$hrSel = { x0: px(ev), x1: px(ev) }; });
      window.addEventListener('mousemove', function (ev) { if (!active) return; chart.$hrSel.x1 = px(ev); chart.draw(); });
      window.addEventListener('mouseup', function () {
        if (!active) return;
        active = false;
        var s = chart.$hrSel;
        chart.$hrSel = null;
        if (Math.abs(s.x1 - s.x0) < 4) { chart.draw(); return; }
        var xs = chart.scales.x;
        zoom(xs.getValueForPixel(Math.min(s.x0, s.x1)) * tu.div, xs.getValueForPixel(Math.max(s.x0, s.x1)) * tu.div);
      });
      canvas.addEventListener('dblclick', reset);
    }
    dragSelect(detailChart);
    dragSelect(overviewChart);
    document.getElementById('timeline-reset').addEventListener('click', reset);
    reset();
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
    // Each point names its techniques where they change from the point before: the planned peak
    // jumps there (e.g. a fused LM head or recomputation from that micro-batch on).
    var labels = S.map(function (r, i) {
      var t = r.techniques || '';
      return (i === 0 || t !== (S[i - 1].techniques || '')) && t ? [String(r.micro_batch), t] : String(r.micro_batch);
    });
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
        plugins: { tooltip: { callbacks: { label: function (c) { return c.dataset.label + ': ' + (c.parsed.y === null ? '—' : fmtBytes(c.parsed.y * su.div)); },
          afterBody: function (items) { var r = S[items[0].dataIndex]; return r.techniques ? 'techniques: ' + r.techniques : ''; } } } }
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
    { label: 'predicted tokens/s', num: true }, { label: 'measured tokens/s', num: true }, { label: 'fits' }, { label: 'techniques' }],
    S.map(function (r) { return [r.micro_batch, fmtBytes(r.planned_peak_bytes), fmtBytes(r.measured_peak_bytes), fmtRate(r.predicted_tokens_per_s), fmtRate(r.measured_tokens_per_s), r.fits ? 'yes' : 'no', r.techniques || '']; }),
    function (i) { return (S[i].micro_batch === ch.micro_batch ? 'chosen' : '') + (S[i].fits ? '' : ' nofit'); });

  // Fragmentation: what the arena holds against what no allocator could beat.
  var fr = [['lower bound', D.lower_bound_bytes, '#94a3b8'], ['arena (plan)', D.arena_bytes, '#2563eb'],
    ['measured peak', D.peak_bytes, '#16a34a'], ['budget', budget, '#c2410c']];
  if (D.pool) fr.push(['pool in use (most)', D.pool.peak_in_use_bytes, '#a855f7'], ['pool reserved then', D.pool.reserved_at_peak_in_use_bytes, '#7c3aed'],
    ['pool reserved (most)', D.pool.peak_reserved_bytes, '#4c1d95']);
  fr = fr.filter(function (r) { return r[1] > 0; });
  // A budget far above the rest would squash every other bar to a sliver: the note gives it then.
  var frOthers = Math.max.apply(null, fr.filter(function (r) { return r[0] !== 'budget'; }).map(function (r) { return r[1]; }).concat([0]));
  var frBudgetHidden = frOthers > 0 && budget > 4 * frOthers;
  if (frBudgetHidden) fr = fr.filter(function (r) { return r[0] !== 'budget'; });
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
    ((D.fragmentation - 1) * 100).toFixed(1) + '% above the most bytes ever live at once).' +
    (D.pool ? ' Pool (the step region, ' + D.pool.block_acquisitions + ' blocks acquired, ' + D.pool.block_releases + ' released): at most ' +
      fmtBytes(D.pool.peak_in_use_bytes) + ' in use of ' + fmtBytes(D.pool.reserved_at_peak_in_use_bytes) + ' reserved (' +
      (100 * D.pool.fragmentation).toFixed(1) + '% unused then), at most ' + fmtBytes(D.pool.peak_reserved_bytes) + ' reserved.' : '') +
    (frBudgetHidden ? ' The budget (' + fmtBytes(budget) + ') is left out of the chart.' : ''));

  // Time per op category.
  var tb = Object.keys(D.time_by_category_ms).map(function (k) { return [k, D.time_by_category_ms[k]]; })
    .sort(function (a, b) { return b[1] - a[1]; });
  if (tb.length === 0) {
    emptyChart('time-by-category', 'No op spans in this profile.');
    setText('time-note', '');
  } else {
    var totalMs = tb.reduce(function (s, r) { return s + r[1]; }, 0);
    // The cost model's time of the same kinds next to the measured one (per step).
    var P = D.predicted_time_by_category_ms || {};
    var hasPred = Object.keys(P).length > 0;
    var timeSets = [{ label: 'measured (ms per step)', data: tb.map(function (r) { return r[1]; }), backgroundColor: '#6366f1' }];
    if (hasPred) timeSets.push({ label: 'predicted by the cost model (ms per step)', data: tb.map(function (r) { return P[r[0]] === undefined ? null : P[r[0]]; }), backgroundColor: '#f59e0b' });
    chartIn('time-by-category', {
      type: 'bar',
      data: { labels: tb.map(function (r) { return r[0]; }), datasets: timeSets },
      options: {
        indexAxis: 'y', scales: { x: { beginAtZero: true, title: axisTitle('time (ms) per step, summed over threads') } },
        plugins: { legend: { display: hasPred }, tooltip: { callbacks: { label: function (c) { return c.dataset.label + ': ' + (c.parsed.x === null ? '—' : fmtMs(c.parsed.x) + ' ms') + (c.datasetIndex === 0 ? ' (' + (100 * c.parsed.x / totalMs).toFixed(1) + '%)' : ''); } } } }
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
    fillTable('markers-table', [{ label: 'time (ms)', num: true }, { label: 'event' }, { label: 'cause' }, { label: 'detail' }],
      M.map(function (m) { return [fmtMs(m.t_us / 1000), m.name, m.cause || '—', m.detail]; }));
  }
  // report.html#zoom=A,B (microseconds) opens zoomed into [A, B].
  var zm = /zoom=([-0-9.e+]+),([-0-9.e+]+)/.exec(location.hash);
  if (zm && window.hrZoom) window.hrZoom(Number(zm[1]), Number(zm[2]));
  // Milliseconds from navigation start to here (page parsed, data decoded, charts drawn).
  document.documentElement.setAttribute('data-ready-ms', performance.now().toFixed(0));
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

// The page is UTF-8 (<meta charset>): ill-formed bytes become U+FFFD here too (core/utf8.h).
std::string html_escape(const std::string& text) {
  const std::string s = valid_utf8(text);
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

void append_base64(std::string& out, const uint8_t* data, size_t n) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  out.reserve(out.size() + (n + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= n; i += 3) {
    const uint32_t v = uint32_t(data[i]) << 16 | uint32_t(data[i + 1]) << 8 | data[i + 2];
    out.push_back(kAlphabet[v >> 18]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(kAlphabet[(v >> 6) & 63]);
    out.push_back(kAlphabet[v & 63]);
  }
  if (i < n) {
    const uint32_t v = uint32_t(data[i]) << 16 | (i + 1 < n ? uint32_t(data[i + 1]) << 8 : 0);
    out.push_back(kAlphabet[v >> 18]);
    out.push_back(kAlphabet[(v >> 12) & 63]);
    out.push_back(i + 1 < n ? kAlphabet[(v >> 6) & 63] : '=');
    out.push_back('=');
  }
}

// The whole timeline at full resolution for the page's zoom (see Note [Profile report],
// "Details on zoom"): one record per change of one category's bytes, as base64 little-endian
// arrays: `t` (float64 microseconds) and `id` (uint16 or uint32 into a dictionary of (category,
// signed delta) pairs, which repeat: a planned buffer has one size). Null above kMaxDetailChanges.
void append_full_timeline(std::string& out, const std::vector<MemorySample>& all,
                          size_t num_categories) {
  std::vector<double> t;
  std::vector<uint32_t> id;
  std::map<std::pair<size_t, int64_t>, uint32_t> dict;
  std::vector<std::pair<size_t, int64_t>> entries;
  std::vector<uint64_t> prev(num_categories, 0);
  for (const MemorySample& m : all) {
    for (size_t c = 0; c < num_categories; ++c) {
      const uint64_t v = c < m.bytes.size() ? m.bytes[c] : 0;
      if (v == prev[c]) continue;
      const auto key = std::make_pair(c, static_cast<int64_t>(v - prev[c]));
      auto [it, inserted] = dict.emplace(key, static_cast<uint32_t>(entries.size()));
      if (inserted) entries.push_back(key);
      t.push_back(m.t_us);
      id.push_back(it->second);
      prev[c] = v;
    }
    if (t.size() > kMaxDetailChanges) {
      out += "null";
      return;
    }
  }
  const bool narrow = entries.size() <= 65536;
  fmt::format_to(std::back_inserter(out), "{{\"n\":{},\"width\":{},\"dict_cat\":[", t.size(),
                 narrow ? 2 : 4);
  for (size_t i = 0; i < entries.size(); ++i) {
    fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", entries[i].first);
  }
  out += "],\"dict_delta\":[";
  for (size_t i = 0; i < entries.size(); ++i) {
    fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", entries[i].second);
  }
  out += "],\"t\":\"";
  static_assert(std::endian::native == std::endian::little, "the page reads little-endian arrays");
  append_base64(out, reinterpret_cast<const uint8_t*>(t.data()), t.size() * sizeof(double));
  out += "\",\"id\":\"";
  if (narrow) {
    std::vector<uint16_t> id16(id.begin(), id.end());
    append_base64(out, reinterpret_cast<const uint8_t*>(id16.data()), id16.size() * 2);
  } else {
    append_base64(out, reinterpret_cast<const uint8_t*>(id.data()), id.size() * 4);
  }
  out += "\"}";
}

// The timeline that the page draws: the window's samples, downsampled, as columns; the whole
// run's totals, downsampled, for the overview; and the full-resolution changes for zooming.
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
  // The whole run for the overview: totals only.
  std::vector<double> all_totals(all.size());
  for (size_t i = 0; i < all.size(); ++i) {
    all_totals[i] = static_cast<double>(detail::sample_total(all[i]));
  }
  const std::vector<size_t> overview = downsample_indices(all_totals, kMaxTimelinePoints);
  out += ",\"overview\":{\"t_us\":[";
  for (size_t k = 0; k < overview.size(); ++k) {
    if (k) out.push_back(',');
    detail::append_json_number(out, all[overview[k]].t_us);
  }
  out += "],\"total\":[";
  for (size_t k = 0; k < overview.size(); ++k) {
    fmt::format_to(std::back_inserter(out), "{}{}", k ? "," : "",
                   static_cast<uint64_t>(all_totals[overview[k]]));
  }
  fmt::format_to(std::back_inserter(out), "],\"total_samples\":{}}}", all.size());
  out += ",\"full\":";
  append_full_timeline(out, all, categories.size());
  // Markers of the whole run, for vertical lines on the timeline (drawn where they fall inside
  // the chart's range).
  out += ",\"markers\":[";
  bool first = true;
  for (const Marker& m : p.markers) {
    out += first ? "{\"t_us\":" : ",{\"t_us\":";
    first = false;
    detail::append_json_number(out, m.t_us);
    out += ",\"name\":";
    detail::append_json_string(out, m.name);
    out += ",\"cause\":";
    detail::append_json_string(out, m.cause);
    out += "}";
  }
  out += "]";
  // The pool and the device line (report/profile.h, PoolSample) over the whole run, downsampled
  // by the device line, drawn over the stack: the gap is memory reserved but not live.
  const std::vector<PoolSample> pool = pool_timeline_from_events(p.events);
  if (!pool.empty()) {
    std::vector<double> dev(pool.size());
    for (size_t i = 0; i < pool.size(); ++i) dev[i] = static_cast<double>(pool[i].device);
    const std::vector<size_t> pk = downsample_indices(dev, kMaxTimelinePoints);
    out += ",\"pool\":{\"t_us\":[";
    for (size_t k = 0; k < pk.size(); ++k) {
      if (k) out.push_back(',');
      detail::append_json_number(out, pool[pk[k]].t_us);
    }
    auto column = [&](const char* name, uint64_t PoolSample::*field) {
      fmt::format_to(std::back_inserter(out), "],\"{}\":[", name);
      for (size_t k = 0; k < pk.size(); ++k) {
        fmt::format_to(std::back_inserter(out), "{}{}", k ? "," : "", pool[pk[k]].*field);
      }
    };
    column("reserved", &PoolSample::reserved);
    column("in_use", &PoolSample::in_use);
    column("device", &PoolSample::device);
    out += "]}";
  }
  out += "}";
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
