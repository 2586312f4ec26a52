#!/usr/bin/python3
"""Generates server/text/unicode_tables.cc: the Unicode data the BERT tokenizer needs (character
classes, canonical decompositions, combining classes, lowercase mappings), as sorted range/array tables
searched by binary search, so that nothing depends on ICU at run time.

The base is this Python's unicodedata (run it with Debian's /usr/bin/python3: Unicode 14.0). The
reference, Hugging Face tokenizers, does not use one Unicode version: its character categories
(unicode_categories 0.1.1) and NFD (unicode-normalization-alignments) are older, its lowercasing and
whitespace come from the Rust standard library, which is newer. Those differences are listed, one code
point per line, in server/text/unicode_reference_deltas.txt, which is derived from the reference itself:

  node tests/reference/hf_tokenize.js --probe > /tmp/probe.txt
  /usr/bin/python3 scripts/gen_unicode_tables.py --derive-deltas /tmp/probe.txt   # rewrites the deltas
  /usr/bin/python3 scripts/gen_unicode_tables.py [--check /tmp/probe.txt]         # rewrites the .cc

--check compares the model of every code point against the probe and fails on any difference.
"""
import argparse
import os
import sys
import unicodedata as ud

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DELTAS = os.path.join(ROOT, 'server', 'text', 'unicode_reference_deltas.txt')
OUT = os.path.join(ROOT, 'server', 'text', 'unicode_tables.cc')

# Rust's char::is_whitespace (the White_Space property).
RUST_WS = {0x9, 0xA, 0xB, 0xC, 0xD, 0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029,
           0x202F, 0x205F, 0x3000}
# tokenizers' normalizers/bert.rs is_chinese_char (note the gap at 2B820..2B91F, as in the reference).
CJK = [(0x3400, 0x4DBF), (0x4E00, 0x9FFF), (0xF900, 0xFAFF), (0x20000, 0x2A6DF), (0x2A700, 0x2B81F),
       (0x2B920, 0x2CEAF), (0x2F800, 0x2FA1F)]
ASCII_PUNCT = set(map(ord, '!"#$%&\'()*+,-./:;<=>?@[\\]^_`{|}~'))
HANGUL_FIRST, HANGUL_LAST = 0xAC00, 0xD7A3

F_WS, F_CONTROL, F_PUNCT, F_MN, F_CJK, F_DECOMP, F_LOWER, F_CCC = (1 << i for i in range(8))


def scalars():
    return (cp for cp in range(0x110000) if not 0xD800 <= cp <= 0xDFFF)


def is_cjk(cp):
    return any(a <= cp <= b for a, b in CJK)


def load_deltas():
    deltas = {}
    if not os.path.exists(DELTAS):
        return deltas
    text = open(DELTAS, encoding='utf-8').read()
    if ('Python %s unicodedata' % ud.unidata_version) not in text:
        sys.exit('%s was derived with another Unicode version than this Python\'s %s: run with '
                 '/usr/bin/python3 (Debian bookworm), or re-derive it with --derive-deltas'
                 % (DELTAS, ud.unidata_version))
    for line in text.splitlines():
        line = line.split('#', 1)[0].strip()
        if not line:
            continue
        f = line.split()
        deltas[(int(f[0], 16), f[1])] = f[2:]
    return deltas


class Model:
    """The reference's per-code-point behaviour: Python's unicodedata plus the deltas."""

    def __init__(self, deltas):
        self.d = deltas

    def _bool(self, cp, prop, base):
        v = self.d.get((cp, prop))
        return base if v is None else v[0] == '1'

    def control(self, cp):  # unicode_categories' is_other(): Cc, Cf, Co; tab, LF, CR excluded
        if cp in (9, 10, 13):
            return False
        return self._bool(cp, 'control', ud.category(chr(cp)) in ('Cc', 'Cf', 'Co'))

    def punct(self, cp):
        return self._bool(cp, 'punct', cp in ASCII_PUNCT or ud.category(chr(cp)).startswith('P'))

    def mn(self, cp):
        return self._bool(cp, 'mn', ud.category(chr(cp)) == 'Mn')

    def ccc(self, cp):
        v = self.d.get((cp, 'ccc'))
        return ud.combining(chr(cp)) if v is None else int(v[0])

    def decomp(self, cp):  # full canonical decomposition, or None
        if HANGUL_FIRST <= cp <= HANGUL_LAST or (cp, 'nodecomp') in self.d:
            return None  # Hangul: algorithmic, in the C++ code
        s = ud.normalize('NFD', chr(cp))
        return None if s == chr(cp) else [ord(c) for c in s]

    def lower(self, cp):  # Rust char::to_lowercase (no context: tokenizers lowercases char by char)
        v = self.d.get((cp, 'lower'))
        if v is not None:
            return [int(x, 16) for x in v]
        s = chr(cp).lower()
        return None if s == chr(cp) else [ord(c) for c in s]

    # The whole normalizer on a string of code points, as the C++ code does it.
    def nfd(self, cps):
        out = []
        for cp in cps:
            if HANGUL_FIRST <= cp <= HANGUL_LAST:
                s = cp - HANGUL_FIRST
                out += [0x1100 + s // 588, 0x1161 + (s % 588) // 28] + ([0x11A7 + s % 28] if s % 28 else [])
            else:
                out += self.decomp(cp) or [cp]
        i = 0
        while i < len(out):  # canonical ordering: stable sort of each run of non-starters
            if self.ccc(out[i]) == 0:
                i += 1
                continue
            j = i
            while j < len(out) and self.ccc(out[j]) != 0:
                j += 1
            out[i:j] = sorted(out[i:j], key=self.ccc)
            i = j
        return out

    def normalize(self, cps, lowercase, strip_accents):
        r = []
        for cp in cps:
            if cp == 0 or cp == 0xFFFD or self.control(cp):
                continue
            if cp in RUST_WS:
                cp = 0x20
            r += [0x20, cp, 0x20] if is_cjk(cp) else [cp]
        if strip_accents:
            r = [c for c in self.nfd(r) if not self.mn(c)]
        if lowercase:
            r = [x for c in r for x in (self.lower(c) or [c])]
        return r

    def probe_line(self, cp):
        cls = 'w' if cp in RUST_WS else 'p' if self.punct(cp) else '-'
        ns = []
        for lc, sa in ((1, 1), (1, 0), (0, 1), (0, 0)):
            r = self.normalize([cp], lc, sa)
            ns.append('=' if r == [cp] else ' '.join('%X' % c for c in r))
        r = '-' if self.nfd([cp, 0x334])[0] != 0x334 else 'r'
        if cls != '-' or r != '-' or any(x != '=' for x in ns):
            return '%X\t%s\t%s\t%s' % (cp, cls, '\t'.join(ns), r)
        return None


def read_probe(path):
    ref = {}
    for line in open(path, encoding='utf-8'):
        line = line.rstrip('\n')
        ref[int(line.split('\t', 1)[0], 16)] = line
    return ref


def derive_deltas(probe_path):
    ref = read_probe(probe_path)
    base = Model({})
    lines = []
    for cp in scalars():
        f = ref.get(cp, '%X\t-\t=\t=\t=\t=\t-' % cp).split('\t')
        cls, n11, n10, n01, n00, rr = f[1:]
        name = ud.name(chr(cp), '<%s>' % ud.category(chr(cp)))
        note = '  # %s (%s)' % (name, ud.category(chr(cp)))
        if cp in (0, 0xFFFD):
            continue  # clean_text drops them before anything else looks at them
        ref_control = n00 == ''
        if ref_control != base.control(cp):
            lines.append('%04X control %d%s' % (cp, ref_control, note))
        if cp in RUST_WS:
            if cls != 'w':
                sys.exit('%X: the reference does not treat it as whitespace' % cp)
            continue
        if (cls == 'p') != base.punct(cp):
            lines.append('%04X punct %d%s' % (cp, cls == 'p', note))
        if ref_control or is_cjk(cp):
            continue
        if base.decomp(cp) is None and not (HANGUL_FIRST <= cp <= HANGUL_LAST):
            if (n01 == '') != base.mn(cp):
                lines.append('%04X mn %d%s' % (cp, n01 == '', note))
        elif base.decomp(cp) is not None and n01 == '=' and not base.mn(cp):
            lines.append('%04X nodecomp%s' % (cp, note))
        ref_lower = [cp] if n10 == '=' else [int(x, 16) for x in n10.split()] if n10 else []
        if ref_lower != (base.lower(cp) or [cp]):
            lines.append('%04X lower %s%s' % (cp, ' '.join('%04X' % c for c in ref_lower), note))
        base_r = 'r' if base.nfd([cp, 0x334])[0] == 0x334 else '-'
        if rr != base_r:
            if rr == 'r':
                sys.exit('%X: the reference gives it a combining class this Python does not' % cp)
            lines.append('%04X ccc 0%s' % (cp, note))
    with open(DELTAS, 'w', encoding='utf-8') as f:
        f.write('# Where Hugging Face tokenizers (the Rust crate, as pinned in tests/reference/package.json)\n'
                '# differs from Python %s unicodedata. Generated by scripts/gen_unicode_tables.py\n'
                '# --derive-deltas from `node tests/reference/hf_tokenize.js --probe`; do not edit.\n'
                '# control/punct/mn: older categories (unicode_categories 0.1.1); ccc 0: marks the\n'
                '# reference NFD does not know; lower: newer Rust char::to_lowercase.\n' % ud.unidata_version)
        f.write('\n'.join(lines) + '\n')
    print('wrote %d deltas to %s' % (len(lines), DELTAS))


def check(model, probe_path):
    ref = read_probe(probe_path)
    bad = [cp for cp in scalars() if model.probe_line(cp) != ref.get(cp)]
    for cp in bad[:20]:
        print('differs: %r vs reference %r' % (model.probe_line(cp), ref.get(cp)))
    if bad:
        sys.exit('%d code points differ from the reference' % len(bad))
    print('all %d scalar values agree with the reference probe' % (0x110000 - 0x800))


def generate(model):
    flags = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            flags.append(0)
            continue
        f = 0
        if cp in RUST_WS: f |= F_WS
        if model.control(cp): f |= F_CONTROL
        if model.punct(cp): f |= F_PUNCT
        if model.mn(cp): f |= F_MN
        if is_cjk(cp): f |= F_CJK
        if model.decomp(cp): f |= F_DECOMP
        if model.lower(cp): f |= F_LOWER
        if model.ccc(cp): f |= F_CCC
        flags.append(f)
    ranges = [(0, flags[0])]
    for cp in range(1, 0x110000):
        if flags[cp] != ranges[-1][1]:
            ranges.append((cp, flags[cp]))
    data = []
    def mapping_table(fn, flag):
        rows = []
        for cp in range(0x110000):
            if flags[cp] & flag:
                m = fn(cp)
                assert 1 <= len(m) <= 7, (cp, m)
                rows.append((cp, len(data), len(m)))
                data.extend(m)
        return rows
    decomp = mapping_table(model.decomp, F_DECOMP)
    lower = mapping_table(model.lower, F_LOWER)
    ccc = [(cp, model.ccc(cp)) for cp in range(0x110000) if flags[cp] & F_CCC]
    assert len(data) < (1 << 24)

    def rows(items, per_line):
        out = []
        for i in range(0, len(items), per_line):
            out.append('    ' + ' '.join(items[i:i + per_line]))
        return '\n'.join(out)
    src = []
    src.append('// GENERATED by scripts/gen_unicode_tables.py from Python %s unicodedata and\n'
               '// server/text/unicode_reference_deltas.txt. Do not edit.\n' % ud.unidata_version)
    src.append('#include "server/text/unicode_tables.h"\n\nnamespace collabserve::text::unicode {\n')
    src.append('const PropertyRange kPropertyRanges[] = {\n%s\n};\n' %
               rows(['{0x%X, %d},' % r for r in ranges], 8))
    src.append('const size_t kNumPropertyRanges = %d;\n' % len(ranges))
    src.append('const uint8_t kAsciiProperties[128] = {\n%s\n};\n' % rows(['%d,' % flags[c] for c in range(128)], 16))
    src.append('const uint32_t kMappingData[] = {\n%s\n};\n' % rows(['0x%X,' % c for c in data], 10))
    src.append('const Mapping kDecompositions[] = {\n%s\n};\n' %
               rows(['{0x%X, %d, %d},' % r for r in decomp], 6))
    src.append('const size_t kNumDecompositions = %d;\n' % len(decomp))
    src.append('const Mapping kLowercase[] = {\n%s\n};\n' % rows(['{0x%X, %d, %d},' % r for r in lower], 6))
    src.append('const size_t kNumLowercase = %d;\n' % len(lower))
    src.append('const CombiningClass kCombiningClasses[] = {\n%s\n};\n' %
               rows(['{0x%X, %d},' % r for r in ccc], 8))
    src.append('const size_t kNumCombiningClasses = %d;\n' % len(ccc))
    src.append('\n}  // namespace collabserve::text::unicode\n')
    with open(OUT, 'w', encoding='utf-8') as f:
        f.write('\n'.join(src))
    print('wrote %s: %d ranges, %d decompositions, %d lowercase mappings, %d combining classes' %
          (OUT, len(ranges), len(decomp), len(lower), len(ccc)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument('--derive-deltas', metavar='PROBE')
    ap.add_argument('--check', metavar='PROBE')
    a = ap.parse_args()
    if a.derive_deltas:
        derive_deltas(a.derive_deltas)
    model = Model(load_deltas())
    if a.check or a.derive_deltas:
        check(model, a.check or a.derive_deltas)
    generate(model)


if __name__ == '__main__':
    main()
