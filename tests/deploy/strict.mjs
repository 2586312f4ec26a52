// Unknown-field check for Kubernetes objects (what `kubeconform -strict` or the API server's
// strict field validation reports). kubernetes-models' validators accept unknown fields, so this walks
// the objects along the field lists of kubernetes-models' TypeScript declarations: each interface
// lists its fields and the interfaces of its nested objects. Inline types (maps, CRD sub-objects)
// and scalars are not descended into.
import fs from 'node:fs';
import path from 'node:path';
import { HERE } from './lib.mjs';

const NM = path.join(HERE, 'node_modules');
const cache = new Map();

function resolveSpec(spec, fromFile) {
  const rel = spec.replace(/\.js$/, '');
  const base = spec.startsWith('.') ? path.resolve(path.dirname(fromFile), rel) : path.join(NM, rel);
  return fs.existsSync(base + '.d.ts') ? base + '.d.ts' : null;
}

function parse(file) {
  if (cache.has(file)) return cache.get(file);
  const text = fs.readFileSync(file, 'utf8');
  const imports = {};
  for (const m of text.matchAll(/import \{([^}]*)\} from "([^"]+)"/g)) {
    for (const part of m[1].split(',')) {
      const [name, alias] = part.trim().split(/\s+as\s+/);
      if (name) imports[(alias || name).trim()] = resolveSpec(m[2], file);
    }
  }
  let fields = null;
  const start = text.search(/^export interface \w+(?: extends [^{]+)? \{$/m);
  if (start >= 0) {
    fields = {};
    for (const line of text.slice(start).split('\n').slice(1)) {
      if (line.startsWith('}')) break;
      const f = /^ {4}"([^"]+)"\??: (.*)$/.exec(line);
      if (f) fields[f[1]] = f[2];
    }
  }
  const parsed = { fields, imports };
  cache.set(file, parsed);
  return parsed;
}

function walk(value, file, where, errors) {
  if (!file || !value || typeof value !== 'object' || Array.isArray(value)) return;
  const { fields, imports } = parse(file);
  if (!fields) return;
  for (const [k, v] of Object.entries(value)) {
    if (!(k in fields)) { errors.push(`${where}.${k}: unknown field`); continue; }
    const t = fields[k];
    let m;
    if ((m = /^Array<(I\w+)>;$/.exec(t)) && Array.isArray(v)) v.forEach((el, i) => walk(el, imports[m[1]], `${where}.${k}[${i}]`, errors));
    else if ((m = /^(I\w+);$/.exec(t))) walk(v, imports[m[1]], `${where}.${k}`, errors);
  }
}

// Returns the unknown fields of `obj` ("Deployment/x.spec.template.spec.containers[0].imagee: unknown field").
export function unknownFields(obj, modelFile) {
  const errors = [];
  walk(obj, modelFile, `${obj.kind}/${obj.metadata && obj.metadata.name}`, errors);
  return errors;
}

export function modelFile(apiVersion, kind) {
  const dir = apiVersion === 'monitoring.coreos.com/v1'
    ? path.join(NM, '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1')
    : path.join(NM, 'kubernetes-models', apiVersion);
  const f = path.join(dir, `${kind}.d.ts`);
  return fs.existsSync(f) ? f : null;
}
