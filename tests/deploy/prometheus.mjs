// deploy_prometheus: promtool accepts the scrape config and the rules, the alerts fire (and stay
// quiet) as tests/deploy/alerts_test.yml specifies, the rules use only the service's metric names,
// the required alerts exist, and deploy/check-metrics.sh accepts a good page and rejects a bad one.
import fs from 'node:fs';
import path from 'node:path';
import { ROOT, HERE, YAML, check, finish, run, promtool, metricNames, knownMetrics, tmpdir } from './lib.mjs';

const pt = promtool();
const cfg = run(pt, ['check', 'config', path.join(ROOT, 'deploy/prometheus/prometheus.yml')]);
check(cfg.status === 0, `promtool check config deploy/prometheus/prometheus.yml:\n${cfg.stdout}${cfg.stderr}`);
const rules = run(pt, ['check', 'rules', path.join(ROOT, 'deploy/prometheus/alerts.yml')]);
check(rules.status === 0, `promtool check rules deploy/prometheus/alerts.yml:\n${rules.stdout}${rules.stderr}`);
const unit = run(pt, ['test', 'rules', path.join(HERE, 'alerts_test.yml')]);
check(unit.status === 0, `promtool test rules tests/deploy/alerts_test.yml:\n${unit.stdout}${unit.stderr}`);

const { known } = knownMetrics();
const alerts = YAML.parse(fs.readFileSync(path.join(ROOT, 'deploy/prometheus/alerts.yml'), 'utf8'));
const names = new Set();
for (const g of alerts.groups) for (const r of g.rules) {
  names.add(r.alert);
  for (const m of metricNames(r.expr)) check(known.has(m), `alert ${r.alert} uses ${m}, which collabserve does not export`);
  check(r.labels && r.labels.severity && r.annotations && r.annotations.summary, `alert ${r.alert} has a severity and a summary`);
}
const uses = (alert, metric) => alerts.groups.flatMap((g) => g.rules).some((r) => r.alert === alert && r.expr.includes(metric));
check(uses('CollabserveHighErrorRate', 'collabserve_requests_total'), 'an error-rate alert on collabserve_requests_total');
check(uses('CollabserveHighLatencyP99', 'collabserve_request_duration_seconds_bucket'), 'a p99 latency alert');
check(uses('CollabserveQueueSaturated', 'collabserve_queue_duration_seconds_bucket') && uses('CollabserveQueueDepthHigh', 'collabserve_queue_depth'), 'queue saturation alerts');
check(uses('CollabserveCompressionJobsFailing', 'collabserve_jobs_total'), 'a failed compression jobs alert');
check(uses('CollabserveModelUnavailable', 'collabserve_model_versions') && uses('CollabserveModelVersionFailed', 'collabserve_model_versions'),
  'alerts on a model with no version serving and on a version that failed to load');
const prom = YAML.parse(fs.readFileSync(path.join(ROOT, 'deploy/prometheus/prometheus.yml'), 'utf8'));
check(prom.rule_files.includes('alerts.yml'), 'prometheus.yml loads alerts.yml');
check(prom.scrape_configs.some((j) => j.job_name === 'collabserve' && j.static_configs[0].targets.includes('collabserve:9090')),
  'prometheus.yml scrapes collabserve:9090 (the compose service and --metrics_port)');

// check-metrics.sh on file:// pages (curl reads them like a URL).
const dir = tmpdir('metrics');
const good = path.join(dir, 'good.prom');
const bad = path.join(dir, 'bad.prom');
fs.writeFileSync(good, '# HELP collabserve_requests_total Requests by model, version and status code.\n# TYPE collabserve_requests_total counter\ncollabserve_requests_total{model="sst2",version="1",code="OK"} 7\n');
fs.writeFileSync(bad, '# HELP collabserve_requests Requests.\n# TYPE collabserve_requests counter\ncollabserve_requests{model="sst2"} 7\n');
const script = path.join(ROOT, 'deploy/check-metrics.sh');
const okRun = run('bash', [script, `file://${good}`]);
check(okRun.status === 0, `check-metrics.sh accepts a well-formed page:\n${okRun.stdout}${okRun.stderr}`);
const badRun = run('bash', [script, `file://${bad}`]);
check(badRun.status !== 0 && badRun.stderr.includes('_total'), `check-metrics.sh rejects a counter without _total, naming it:\n${badRun.stderr}`);
const noRun = run('bash', [script, `file://${dir}/missing.prom`]);
check(noRun.status !== 0 && noRun.stderr.includes('cannot fetch'), 'check-metrics.sh reports an unreachable URL');
finish('deploy_prometheus');
