// deploy_grafana: the dashboard parses, covers what operators look at, uses only the service's
// metric names, and every query is valid PromQL (promtool parses each one as a recording rule).
import fs from 'node:fs';
import path from 'node:path';
import { ROOT, YAML, check, fatal, finish, run, promtool, metricNames, knownMetrics, tmpdir } from './lib.mjs';

const file = path.join(ROOT, 'deploy/grafana/collabserve.json');
let dash;
try { dash = JSON.parse(fs.readFileSync(file, 'utf8')); } catch (e) { fatal(`${file}: ${e.message}`); }
check(dash.uid && dash.title && Array.isArray(dash.panels), 'dashboard has uid, title and panels');
const { known } = knownMetrics();
const panels = dash.panels.flatMap((p) => [p, ...(p.panels || [])]).filter((p) => p.type !== 'row');
const ids = new Set();
const exprs = [];
for (const p of panels) {
  check(!ids.has(p.id), `panel id ${p.id} is unique`); ids.add(p.id);
  check(p.gridPos && p.gridPos.w > 0 && p.gridPos.h > 0, `panel "${p.title}" has a grid position`);
  check(Array.isArray(p.targets) && p.targets.length > 0, `panel "${p.title}" has queries`);
  for (const t of p.targets || []) {
    check(typeof t.expr === 'string' && t.expr.length > 0, `panel "${p.title}" target ${t.refId} has an expr`);
    for (const m of metricNames(t.expr)) check(known.has(m), `panel "${p.title}" uses ${m}, which collabserve does not export`);
    exprs.push({ title: p.title, expr: t.expr });
  }
}
// A query of a byte count is drawn in bytes, on its own axis when the panel's default unit is another
// (the fidelity panel once drew a 0-1 agreement and bytes per hour on one axis).
const BYTE_UNITS = new Set(['bytes', 'decbytes']);
for (const p of panels) {
  const fc = p.fieldConfig || {};
  const defaults = fc.defaults || {};
  for (const t of p.targets || []) {
    if (!metricNames(t.expr || '').some((m) => /_bytes(_total)?$/.test(m))) continue;
    const props = (fc.overrides || []).filter((o) => o.matcher && o.matcher.id === 'byFrameRefID' && o.matcher.options === t.refId)
      .flatMap((o) => o.properties || []);
    const prop = (id) => { const x = props.find((q) => q.id === id); return x ? x.value : undefined; };
    const unit = prop('unit') ?? defaults.unit;
    check(BYTE_UNITS.has(unit), `panel "${p.title}" target ${t.refId} counts bytes but is drawn in ${unit}`);
    if (prop('unit') !== undefined && !BYTE_UNITS.has(defaults.unit)) {
      check(prop('custom.axisPlacement') === 'right', `panel "${p.title}" target ${t.refId} has its own unit but shares the left axis`);
    }
  }
}
const all = exprs.map((e) => e.expr).join('\n');
for (const [what, metric] of [['latency', 'collabserve_request_duration_seconds_bucket'], ['throughput', 'collabserve_requests_total'],
  ['batch size', 'collabserve_batch_size_'], ['padding ratio', 'collabserve_batch_padding_ratio_'], ['queue depth', 'collabserve_queue_depth'],
  ['parameters', 'collabserve_model_parameters'], ['compression ratio', 'collabserve_model_compression_ratio'],
  ['rank per layer', 'collabserve_model_layer_rank'], ['jobs', 'collabserve_jobs_total'],
  ['GPU failures', 'collabserve_device_failed'], ['versions by state', 'collabserve_model_versions'],
  ['REST responses', 'collabserve_http_responses_total']]) {
  check(all.includes(metric), `the dashboard shows ${what} (${metric})`);
}
check(/histogram_quantile\(0\.5,/.test(all) && /histogram_quantile\(0\.99,/.test(all), 'latency p50 and p99');
const vars = (dash.templating && dash.templating.list) || [];
check(vars.some((v) => v.name === 'datasource' && v.type === 'datasource' && v.query === 'prometheus'), 'a Prometheus datasource variable');
const used = new Set([...JSON.stringify(dash.panels).matchAll(/\$\{?(\w+)/g)].map((m) => m[1]).filter((v) => !v.startsWith('__')));
for (const v of used) check(vars.some((x) => x.name === v), `variable $${v} is used but not defined`);

// Grafana's macros replaced by what they stand for, then every query is parsed by promtool.
const dir = tmpdir('grafana');
const rulesFile = path.join(dir, 'dashboard-rules.yml');
const subst = (e) => e.replace(/\$__rate_interval|\$__interval|\$__range/g, '5m').replace(/\$\{?model\}?/g, '.*');
fs.writeFileSync(rulesFile, YAML.stringify({ groups: [{ name: 'dashboard', rules: exprs.map((e, i) => ({ record: `dashboard:query_${i}`, expr: subst(e.expr) })) }] }));
const r = run(promtool(), ['check', 'rules', rulesFile]);
check(r.status === 0, `a dashboard query is not valid PromQL:\n${r.stdout}${r.stderr}`);

// Provisioning for docker-compose.
const ds = YAML.parse(fs.readFileSync(path.join(ROOT, 'deploy/grafana/provisioning/datasources/prometheus.yml'), 'utf8'));
check(ds.datasources[0].type === 'prometheus' && ds.datasources[0].url === 'http://prometheus:9090', 'provisioned datasource points at the compose Prometheus');
const prov = YAML.parse(fs.readFileSync(path.join(ROOT, 'deploy/grafana/provisioning/dashboards/collabserve.yml'), 'utf8'));
check(prov.providers[0].options.path === '/var/lib/grafana/dashboards', 'dashboard provider reads /var/lib/grafana/dashboards');
finish('deploy_grafana');
