// Reads helm/collabserve/values.yaml with its comments: every leaf value (scalar, list, or empty
// map) with the comment block right above it (or above its nearest parent map that has one).
// `node values-doc.mjs` prints the README table; the helm test uses valuesDoc() to check that every
// value is documented in values.yaml and in README.md.
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import YAML from 'yaml';

// The comment block right above a key; for the first key of a map the parser attaches it to the
// map itself. Only the last paragraph counts (a file header is separated by a blank line).
function commentOf(pair, parentMap) {
  const raw = pair.key.commentBefore || (parentMap && parentMap.commentBefore) || '';
  const paragraphs = raw.split(/\n\s*\n/);
  return paragraphs[paragraphs.length - 1].trim();
}

export function valuesDoc(file) {
  const doc = YAML.parseDocument(fs.readFileSync(file, 'utf8'));
  if (doc.errors.length) throw new Error(`${file}: ${doc.errors[0].message}`);
  const rows = [];
  const walk = (node, prefix, inherited) => {
    node.items.forEach((pair, i) => {
      const key = String(pair.key.value);
      const p = prefix ? `${prefix}.${key}` : key;
      const comment = commentOf(pair, i === 0 ? node : null);
      const v = pair.value;
      if (YAML.isMap(v) && v.items.length > 0 && !v.flow) {
        // A map whose own comment documents it as a whole (e.g. resources) is one row.
        const childrenDocumented = v.items.every((c, i) => commentOf(c, i === 0 ? v : null));
        if (comment && !childrenDocumented) {
          rows.push({ key: p, comment, value: v.toJSON() });
        } else {
          walk(v, p, comment);
        }
      } else {
        rows.push({ key: p, comment, value: v ? v.toJSON() : null });
      }
    });
  };
  walk(doc.contents, '', '');
  return rows;
}

export function markdownTable(rows) {
  const esc = (s) => s.replace(/\|/g, '\\|').replace(/\s*\n\s*/g, ' ');
  const lines = ['| Key | Default | Description |', '| --- | --- | --- |'];
  for (const r of rows) lines.push(`| \`${r.key}\` | \`${esc(JSON.stringify(r.value))}\` | ${esc(r.comment)} |`);
  return lines.join('\n');
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
  console.log(markdownTable(valuesDoc(path.join(root, 'helm/collabserve/values.yaml'))));
}
