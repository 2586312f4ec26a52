#!/usr/bin/env node
// Reference for collabserve's BERT tokenizer: Hugging Face tokenizers (the Rust crate, through the
// @anush008/tokenizers Node binding) assembled exactly as BertTokenizerFast builds it: BertNormalizer,
// BertPreTokenizer, WordPiece (max_input_chars_per_word 100, "##"), BertProcessing, special tokens as
// non-normalized added tokens, LongestFirst truncation.
//
//   node hf_tokenize.js --vocab VOCAB [--lowercase 0|1] [--strip-accents 0|1] [--split-special-tokens]
//        < in.jsonl > out.jsonl
//     Each input line is {"text": ..., "text_pair"?: ..., "max_length"?: N}; each output line is
//     {"ids": [...], "type_ids": [...], "offsets": [[start, end], ...], "special": [0|1, ...],
//     "normalized": [text, text_pair?]} (or {"error": "..."}), in the same order; "offsets" are
//     each token's span in its own text in code points (the binding's encode gives char offsets),
//     "special" the special tokens mask, "normalized" the BertNormalizer output of each whole text,
//     "decoded" and "decoded_all" tokenizer.decode of the ids (WordPiece decoder, "##", cleanup)
//     without and with the special tokens.
//   node hf_tokenize.js --probe > table.txt
//     For every Unicode scalar value whose behaviour is not the default one, prints
//     "HEX\tCLASS\tN11\tN10\tN01\tN00\tR" where CLASS is w (whitespace: dropped by the
//     pre-tokenizer), p (punctuation: isolated) or - (neither), Nxy is BertNormalizer(lowercase=x,
//     strip_accents=y) applied to the character alone, as space-separated hex code points, "" when the
//     character is removed, or "=" when it is unchanged, and R is "r" when NFD moves the character
//     after U+0334 (canonical combining class > 1), else "-". The C++ test compares this line by line.
'use strict';

const fs = require('fs');
const readline = require('readline');
let tk;
try {
  tk = require('@anush008/tokenizers');
} catch (e) {
  process.stderr.write('hf_tokenize.js: cannot load @anush008/tokenizers (run `npm ci` in ' +
                       'tests/reference or scripts/install-deps.sh): ' + e.message + '\n');
  process.exit(3);
}

function parseArgs(argv) {
  const args = {vocab: null, lowercase: true, stripAccents: null, splitSpecial: false, probe: false};
  for (let i = 0; i < argv.length; i++) {
    const a = argv[i];
    if (a === '--vocab') args.vocab = argv[++i];
    else if (a === '--lowercase') args.lowercase = argv[++i] === '1';
    else if (a === '--strip-accents') args.stripAccents = argv[++i] === '1';
    else if (a === '--split-special-tokens') args.splitSpecial = true;
    else if (a === '--probe') args.probe = true;
    else throw new Error('unknown argument ' + a);
  }
  return args;
}

function hex(s) {
  return Array.from(s, (c) => c.codePointAt(0).toString(16).toUpperCase()).join(' ');
}

function probe() {
  const pre = tk.bertPreTokenizer();
  const norms = [[true, true], [true, false], [false, true], [false, false]].map(
      ([lc, sa]) => tk.bertNormalizer(
          {cleanText: true, handleChineseChars: true, stripAccents: sa, lowercase: lc}));
  const nfd = tk.nfdNormalizer();
  const out = [];
  for (let cp = 0; cp <= 0x10FFFF; cp++) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    const ch = String.fromCodePoint(cp);
    const pieces = pre.preTokenizeString('a' + ch + 'b').length;
    const cls = pieces === 2 ? 'w' : pieces === 3 ? 'p' : '-';
    const ns = norms.map((n) => {
      const r = n.normalizeString(ch);
      return r === ch ? '=' : hex(r);
    });
    const reordered = nfd.normalizeString(ch + '\u0334').startsWith('\u0334') ? 'r' : '-';
    if (cls !== '-' || reordered !== '-' || ns.some((x) => x !== '=')) {
      out.push(cp.toString(16).toUpperCase() + '\t' + cls + '\t' + ns.join('\t') + '\t' + reordered);
      if (out.length >= 4096) { process.stdout.write(out.join('\n') + '\n'); out.length = 0; }
    }
  }
  if (out.length) process.stdout.write(out.join('\n') + '\n');
}

async function encodeAll(args) {
  if (!args.vocab) throw new Error('--vocab is required');
  const model = await tk.WordPiece.fromFile(args.vocab, {unkToken: '[UNK]', continuingSubwordPrefix: '##',
                                                          maxInputCharsPerWord: 100});
  const tokenizer = new tk.Tokenizer(model);
  const normOpts = {cleanText: true, handleChineseChars: true, lowercase: args.lowercase};
  if (args.stripAccents !== null) normOpts.stripAccents = args.stripAccents;
  const normalizer = tk.bertNormalizer(normOpts);
  tokenizer.setNormalizer(normalizer);
  tokenizer.setPreTokenizer(tk.bertPreTokenizer());
  const id = (t) => {
    const v = tokenizer.tokenToId(t);
    if (v === null || v === undefined) throw new Error(t + ' is not in ' + args.vocab);
    return v;
  };
  tokenizer.setPostProcessor(tk.bertProcessing(['[SEP]', id('[SEP]')], ['[CLS]', id('[CLS]')]));
  tokenizer.setDecoder(tk.wordPieceDecoder('##', true));
  if (!args.splitSpecial) tokenizer.addSpecialTokens(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']);
  // Decoding knows the special tokens even when encoding splits them (BertTokenizerFast's
  // split_special_tokens only changes how text is matched): a decoder with them added.
  let decoder = tokenizer;
  if (args.splitSpecial) {
    decoder = new tk.Tokenizer(await tk.WordPiece.fromFile(args.vocab, {unkToken: '[UNK]',
        continuingSubwordPrefix: '##', maxInputCharsPerWord: 100}));
    decoder.setDecoder(tk.wordPieceDecoder('##', true));
    decoder.addSpecialTokens(['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]']);
  }

  const rl = readline.createInterface({input: process.stdin, crlfDelay: Infinity});
  for await (const line of rl) {
    if (line.trim() === '') continue;
    let result;
    try {
      const req = JSON.parse(line);
      if (req.max_length !== undefined && req.max_length !== null) {
        tokenizer.setTruncation(req.max_length, {strategy: 'LongestFirst'});
      } else {
        tokenizer.disableTruncation();
      }
      const pair = req.text_pair === undefined ? null : req.text_pair;
      const enc = await tokenizer.encode(req.text, pair);
      const normalized = [normalizer.normalizeString(req.text)];
      if (pair !== null) normalized.push(normalizer.normalizeString(pair));
      result = {ids: enc.getIds(), type_ids: enc.getTypeIds(), offsets: enc.getOffsets(),
                special: enc.getSpecialTokensMask(), normalized,
                decoded: await decoder.decode(enc.getIds(), true),
                decoded_all: await decoder.decode(enc.getIds(), false)};
    } catch (e) {
      result = {error: String(e && e.message ? e.message : e)};
    }
    process.stdout.write(JSON.stringify(result) + '\n');
  }
}

function main() {
  const args = parseArgs(process.argv.slice(2));
  if (args.probe) return probe();
  return encodeAll(args);
}

Promise.resolve(main()).catch((e) => {
  process.stderr.write('hf_tokenize.js: ' + (e && e.stack ? e.stack : e) + '\n');
  process.exit(2);
});
