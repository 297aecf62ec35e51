#!/usr/bin/env node
// Checks a token file that `headroom prepare` made from Debian's fortunes against an independent
// encoder, document by document: tokenizers.js for a tokenizer.json, SentencePiece (WASM) for a
// tokenizer.model. Documents whose text is not valid UTF-8 are skipped (JavaScript cannot hold
// them) and counted. Exits 1 on any difference.
//
// Usage (after scripts/get-tokenizers and a build):
//   build/release/headroom prepare /usr/share/games/fortunes --doc-separator % \
//       --tokenizer third_party/tokenizers/llama3 --out /tmp/f.tok
//   node tools/tokenizer/compare_fortunes.mjs third_party/tokenizers/llama3 /tmp/f.tok
import fs from 'fs';
import path from 'path';
import { fileURLToPath } from 'url';

const repo = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..', '..');
const nm = path.join(repo, 'third_party', 'tokenizers', 'npm', 'node_modules');
const [dir, tokPath] = process.argv.slice(2);
if (!dir || !tokPath) {
  console.error('usage: compare_fortunes.mjs TOKENIZER_DIR TOKEN_FILE');
  process.exit(2);
}

let encode;
if (fs.existsSync(path.join(dir, 'tokenizer.json'))) {
  const { Tokenizer } = await import(path.join(nm, '@huggingface/tokenizers/dist/tokenizers.mjs'));
  const json = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf-8'));
  const cfgPath = path.join(dir, 'tokenizer_config.json');
  const config = fs.existsSync(cfgPath) ? JSON.parse(fs.readFileSync(cfgPath, 'utf-8')) : {};
  json.added_tokens = [];  // headroom's prepare does not match special tokens in text
  const tok = new Tokenizer(json, config);
  encode = t => tok.encode(t, { add_special_tokens: false }).ids;
} else {
  const spm = await import(path.join(nm, '@sctg/sentencepiece-js/dist/index.js'));
  const sp = new spm.SentencePieceProcessor();
  await sp.load(path.join(dir, 'tokenizer.model'));
  encode = t => Array.from(sp.encodeIds(t));
}

// The token file (src/data/token_file.h): 64-byte header, then tokens; each document ends with eot.
const buf = fs.readFileSync(tokPath);
const width = buf.readUInt32LE(12), count = Number(buf.readBigUInt64LE(16)), eot = buf.readUInt32LE(28);
const ours = [[]];
for (let i = 0; i < count; i++) {
  const t = width === 2 ? buf.readUInt16LE(64 + 2 * i) : buf.readUInt32LE(64 + 4 * i);
  if (t === eot) ours.push([]); else ours[ours.length - 1].push(t);
}
ours.pop();

// The documents as prepare splits them: sorted files without an extension, "%" lines between
// documents, whitespace-only documents dropped.
const fdir = '/usr/share/games/fortunes';
const docs = [];
const blank = s => !/[^ \t\n\r\f\v]/.test(s);
for (const f of fs.readdirSync(fdir).filter(n => !n.startsWith('.') && !n.includes('.')).sort()) {
  const lines = fs.readFileSync(path.join(fdir, f)).toString('utf-8').split('\n');
  let acc = '';
  lines.forEach((line, i) => {
    const last = i === lines.length - 1;
    if ((line.endsWith('\r') ? line.slice(0, -1) : line) === '%') {
      if (!blank(acc)) docs.push(acc);
      acc = '';
    } else {
      acc += line + (last ? '' : '\n');
    }
  });
  if (!blank(acc)) docs.push(acc);
}

let same = 0, skipped = 0;
const diffs = [];
if (docs.length !== ours.length) {
  console.error(`compare_fortunes: ${docs.length} documents, the token file has ${ours.length}`);
  process.exit(1);
}
docs.forEach((d, i) => {
  if (d.includes('\uFFFD')) { skipped++; return; }
  const want = encode(d);
  if (want.length === ours[i].length && want.every((x, k) => x === ours[i][k])) same++;
  else diffs.push(i);
});
console.log(`compare_fortunes: ${dir}: ${same} of ${docs.length} documents identical, ` +
            `${diffs.length} differ, ${skipped} skipped (not valid UTF-8)`);
if (diffs.length) {
  const i = diffs[0];
  console.log(`first difference: document ${i}: ${JSON.stringify(docs[i].slice(0, 200))}`);
  process.exit(1);
}
