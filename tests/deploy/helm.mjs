// deploy_helm: the chart lints, renders for the value sets users will use, every object validates
// against the Kubernetes schemas, the rendered objects behave as documented, and every value is
// used, defined and documented.
import fs from 'node:fs';
import path from 'node:path';
import { ROOT, YAML, check, fatal, finish, k8sTools, run, tmpdir, parseDocs, validateK8s, find } from './lib.mjs';
// After lib.mjs, which fails clearly when node_modules is missing.
const { valuesDoc, markdownTable } = await import('./values-doc.mjs');

const chart = path.join(ROOT, 'helm/collabserve');
const { helm } = k8sTools();
const home = tmpdir('helm');
const env = { ...process.env, HELM_CACHE_HOME: home, HELM_CONFIG_HOME: home, HELM_DATA_HOME: home };

const chartYaml = YAML.parse(fs.readFileSync(path.join(chart, 'Chart.yaml'), 'utf8'));
check(chartYaml.apiVersion === 'v2' && chartYaml.name === 'collabserve' && /^\d+\.\d+\.\d+/.test(chartYaml.version),
  'Chart.yaml: apiVersion v2, name collabserve and a semver version');

function template(sets, { expectFail } = {}) {
  const args = ['template', 'cs', chart, '--namespace', 'ml', '--kube-version', '1.29.0'];
  // "S:" marks a --set-string (label values such as "true" must stay strings), "J:" a --set-json
  // (a number as a values file gives it).
  for (const s of sets) {
    args.push(...(s.startsWith('S:') ? ['--set-string', s.slice(2)] : s.startsWith('J:') ? ['--set-json', s.slice(2)] : ['--set', s]));
  }
  const r = run(helm, args, { env });
  if (expectFail) return r;
  if (r.status !== 0) fatal(`helm template ${sets.join(' ')} failed:\n${r.stderr}`);
  return parseDocs(r.stdout, `helm template ${sets.join(' ')}`);
}

// NOTES.txt as `helm install` prints it. helm template skips it, so a copy of the chart renders it
// as a named template, quoted into a YAML document.
const notesChart = path.join(tmpdir('notes'), 'collabserve');
fs.cpSync(chart, notesChart, { recursive: true });
const notesText = fs.readFileSync(path.join(notesChart, 'templates/NOTES.txt'), 'utf8');
fs.rmSync(path.join(notesChart, 'templates/NOTES.txt'));
fs.writeFileSync(path.join(notesChart, 'templates/_notes.tpl'), `{{- define "notes" -}}\n${notesText}{{- end }}\n`);
fs.writeFileSync(path.join(notesChart, 'templates/notes.yaml'), 'notes: {{ include "notes" . | toJson }}\n');
function notes(sets) {
  const args = ['template', 'cs', notesChart, '--namespace', 'ml', '--show-only', 'templates/notes.yaml'];
  for (const s of sets) args.push('--set', s);
  const r = run(helm, args, { env });
  if (r.status !== 0) fatal(`NOTES.txt with ${sets.join(' ')} failed:\n${r.stderr}`);
  return YAML.parse(r.stdout).notes;
}

const lint = run(helm, ['lint', '--strict', chart, '--namespace', 'ml'], { env });
check(lint.status === 0, `helm lint --strict failed:\n${lint.stdout}${lint.stderr}`);
const lintGpu = run(helm, ['lint', '--strict', chart, '--set', 'gpu.enabled=true,replicaCount=3,autoscaling.enabled=true,autoscaling.metric=queueTime,serviceMonitor.enabled=true,admin.service.enabled=true,tls.enabled=true,tls.secretName=t'], { env });
check(lintGpu.status === 0, `helm lint --strict with every option on failed:\n${lintGpu.stdout}${lintGpu.stderr}`);

const dep = (objs) => find(objs, 'Deployment')[0];
const ctr = (objs) => dep(objs).spec.template.spec.containers[0];

// Defaults: CPU, one pod, RWO claim, no admin Service, NetworkPolicy on.
const def = template([]);
await validateK8s(def, 'defaults');
const kinds = def.map((o) => o.kind).sort().join(',');
check(kinds === 'ConfigMap,Deployment,NetworkPolicy,PersistentVolumeClaim,PodDisruptionBudget,Secret,Service,ServiceAccount',
  `defaults render ConfigMap, Deployment, NetworkPolicy, PVC, PDB, Secret, Service, ServiceAccount; got ${kinds}`);
const c = ctr(def);
const pod = dep(def).spec.template.spec;
check(find(def, 'PersistentVolumeClaim')[0].spec.accessModes[0] === 'ReadWriteOnce', 'one pod: the model claim is ReadWriteOnce');
for (const p of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
  check(c[p] && c[p].grpc && c[p].grpc.port === 8500, `${p} is a native gRPC probe on port 8500`);
}
check(c.readinessProbe.grpc.service === '' && c.startupProbe.grpc.service === '', 'readiness and startup ask the server\'s health by default');
check(ctr(template(['probes.readiness.service=demo'])).readinessProbe.grpc.service === 'demo',
  'probes.readiness.service makes readiness follow that model');
check(pod.terminationGracePeriodSeconds === 30 + 5 + 5, `terminationGracePeriodSeconds = drain 30 + preStop 5 + margin 5, got ${pod.terminationGracePeriodSeconds}`);
check(JSON.stringify(c.lifecycle.preStop.exec.command) === '["sleep","5"]', 'preStop sleeps 5 s');
check(c.livenessProbe.periodSeconds * c.livenessProbe.failureThreshold > 35, 'liveness tolerates a whole preStop + drain');
check(pod.securityContext.runAsNonRoot === true && pod.securityContext.runAsUser !== 0, 'pod runs as non-root');
check(c.securityContext.readOnlyRootFilesystem === true && c.securityContext.allowPrivilegeEscalation === false, 'read-only root filesystem, no privilege escalation');
check(c.volumeMounts.some((m) => m.mountPath === '/tmp') && pod.volumes.some((v) => v.name === 'tmp' && v.emptyDir), '/tmp is an emptyDir');
check(!c.resources.limits || !('nvidia.com/gpu' in c.resources.limits), 'no GPU requested by default');
check(c.image === `collabserve:${chartYaml.appVersion}`, `the CPU image is tagged with the appVersion; got ${c.image}`);
check(ctr(template(['gpu.enabled=true'])).image === `collabserve:${chartYaml.appVersion}-cuda`,
  'gpu.enabled alone picks the cuda image (appVersion-cuda)');
check(ctr(template(['gpu.enabled=true', 'image.tag=mine'])).image === 'collabserve:mine', 'image.tag overrides the default tag');
const gpuNotes = notes(['gpu.enabled=true']);
check(gpuNotes.includes(`Image: collabserve:${chartYaml.appVersion}-cuda.`) && !gpuNotes.includes('WARNING'),
  `NOTES: gpu.enabled names the cuda image and does not warn; got:\n${gpuNotes}`);
check(notes(['gpu.enabled=true', `image.tag=${chartYaml.appVersion}`]).includes('WARNING: gpu.enabled is set but image'),
  'NOTES: gpu.enabled with the CPU image warns');
{
  // The REST lines follow the port, TLS and mutual TLS; /metrics names the Service that has it.
  const plain = notes([]), tls = notes(['tls.enabled=true', 'tls.secretName=t', 'tls.clientCA.enabled=true']);
  check(plain.includes("curl http://localhost:8000/v2/models/MODEL/infer -d '{") &&
    tls.includes('curl --cacert CA.crt --cert CLIENT.crt --key CLIENT.key --connect-to cs-collabserve.ml.svc:8000:127.0.0.1:8000 https://cs-collabserve.ml.svc:8000/v2/models/MODEL/infer') &&
    !notes(['server.httpPort=0']).includes('REST ('), `NOTES: the REST lines; got:\n${plain}`);
  check(plain.includes('Metrics: http://cs-collabserve.ml.svc:9090/metrics') &&
    notes(['service.type=LoadBalancer']).includes('Metrics: http://cs-collabserve-metrics.ml.svc:9090/metrics'),
    `NOTES: the metrics Service; got:\n${plain}`);
}
check(notes([]).includes('collabctl --address=127.0.0.1:8500 health') &&
  notes(['tls.enabled=true', 'tls.secretName=t']).includes('collabctl --address=127.0.0.1:8500 --tls health'),
  'NOTES: the collabctl command, with --tls under tls.enabled');
const cm = find(def, 'ConfigMap')[0];
// $(VAR): from the ConfigMap, or the CPU request through the downward API.
const fromEnv = new Map((c.env || []).filter((e) => e.valueFrom).map((e) => [e.name, e.valueFrom]));
const args = c.args.map((a) => a.replace(/\$\((\w+)\)/g, (_, v) => {
  if (fromEnv.has(v)) return `<${v}>`;
  check(v in cm.data, `arg ${a} references ${v}, which the ConfigMap lacks`);
  return cm.data[v];
}));
{
  // Without a CPU limit the server would size its threads for the node: --cpus is the request.
  const ref = fromEnv.get('COLLABSERVE_CPUS');
  check(ref && ref.resourceFieldRef.resource === 'requests.cpu' && ref.resourceFieldRef.containerName === 'collabserve' &&
    args.includes('--cpus=<COLLABSERVE_CPUS>'), `--cpus comes from the container's CPU request; got ${args.join(' ')}`);
  const own = template(['server.flags.cpus=3']);
  check(find(own, 'ConfigMap')[0].data.COLLABSERVE_CPUS === '3' && !ctr(own).env.some((e) => e.valueFrom) &&
    ctr(own).args.filter((a) => a.startsWith('--cpus=')).length === 1, 'server.flags.cpus replaces the request');
  const none = template(['resources.requests=null']);
  check(!ctr(none).args.some((a) => a.startsWith('--cpus')), 'no CPU request: the server detects its CPUs');
}
for (const want of ['--port=8500', '--admin_port=8501', '--metrics_port=9090', '--drain_timeout_s=30', '--device=cpu',
  '--model_repository=/models', '--admin_token_file=/etc/collabserve/admin/token']) {
  check(args.includes(want), `args after ConfigMap expansion contain ${want}; got ${args.join(' ')}`);
}
check(!args.some((a) => a.startsWith('--max_batch_size')), 'flags left empty in values are not passed');
check(c.volumeMounts.some((m) => m.mountPath === '/etc/collabserve/admin') &&
  pod.volumes.some((v) => v.secret && v.secret.secretName === find(def, 'Secret')[0].metadata.name), 'admin token Secret is mounted');
check(Buffer.from(find(def, 'Secret')[0].data.token, 'base64').length >= 32, 'a random admin token of >= 32 characters is generated');
const np = find(def, 'NetworkPolicy')[0];
const adminRule = np.spec.ingress.find((r) => r.ports.some((p) => p.port === 'admin'));
check(adminRule && adminRule.from && adminRule.from.length > 0, 'NetworkPolicy admits the admin port only from listed peers');
check(np.spec.ingress.some((r) => r.ports.some((p) => p.port === 'grpc') && !r.from), 'NetworkPolicy leaves the gRPC port open');
const svc = find(def, 'Service')[0];
check(svc.spec.ports.map((p) => p.name).join(',') === 'grpc,metrics,http' && !svc.spec.ports.some((p) => p.port === 8501),
  'the main Service has grpc, metrics and http, not the admin port');
check(np.spec.ingress.some((r) => r.ports.some((p) => p.port === 'http') && !r.from), 'NetworkPolicy leaves the REST port open');
check(ctr(def).ports.some((p) => p.name === 'http' && p.containerPort === 8000) && ctr(def).args.includes('--http_port=$(COLLABSERVE_HTTP_PORT)') &&
  find(def, 'ConfigMap')[0].data.COLLABSERVE_HTTP_PORT === '8000', 'the REST port is the container\'s http port, 8000 by default');
{
  // server.httpPort=0: no REST endpoint, no port anywhere; httpFrom restricts it like grpcFrom.
  const off = template(['server.httpPort=0']);
  check(find(off, 'ConfigMap')[0].data.COLLABSERVE_HTTP_PORT === '-1' && !ctr(off).ports.some((p) => p.name === 'http') &&
    !find(off, 'Service')[0].spec.ports.some((p) => p.name === 'http') &&
    !find(off, 'NetworkPolicy')[0].spec.ingress.some((r) => r.ports.some((p) => p.port === 'http')),
    'server.httpPort=0 turns the REST endpoint off (--http_port=-1) and leaves its port out');
  const limited = template(['admin.networkPolicy.httpFrom[0].podSelector.matchLabels.rest=yes', 'tls.enabled=true', 'tls.secretName=t']);
  const rule = find(limited, 'NetworkPolicy')[0].spec.ingress.find((r) => r.ports.some((p) => p.port === 'http'));
  check(rule && rule.from && rule.from[0].podSelector.matchLabels.rest === 'yes', 'admin.networkPolicy.httpFrom restricts the REST port');
  check(find(limited, 'Service')[0].spec.ports.find((p) => p.name === 'http').appProtocol === 'https', 'under TLS the REST port is https');
  // A LoadBalancer publishes every port of its Service: /metrics goes to a ClusterIP one, which
  // the ServiceMonitor (selecting by the pods' labels, port "metrics") still finds.
  const lb = template(['service.type=LoadBalancer', 'serviceMonitor.enabled=true']);
  const [pub, ...rest] = find(lb, 'Service', (o) => !o.metadata.name.endsWith('-admin'));
  check(pub.spec.type === 'LoadBalancer' && pub.spec.ports.map((p) => p.name).join(',') === 'grpc,http' && rest.length === 1 &&
    rest[0].metadata.name.endsWith('-metrics') && rest[0].spec.type === 'ClusterIP' &&
    rest[0].spec.ports.map((p) => p.name).join(',') === 'metrics',
    'service.type=LoadBalancer publishes grpc and http; metrics on a ClusterIP -metrics Service');
  const sm = find(lb, 'ServiceMonitor')[0];
  check(Object.entries(sm.spec.selector.matchLabels).every(([k, v]) => rest[0].metadata.labels[k] === v) &&
    sm.spec.endpoints[0].port === 'metrics', 'the ServiceMonitor selects the -metrics Service');
}
const cpuChecksum = dep(def).spec.template.metadata.annotations['checksum/config'];
// Rollouts: one CPU pod on a ReadWriteOnce claim cannot surge (the volume attaches to one node);
// neither can a GPU pod (no spare GPU); several pods on a ReadWriteMany claim keep full capacity.
const strategy = (objs) => {
  const r = dep(objs).spec.strategy.rollingUpdate;
  return JSON.stringify({ maxUnavailable: r.maxUnavailable, maxSurge: r.maxSurge });
};
check(strategy(def) === '{"maxUnavailable":1,"maxSurge":0}', `RWO claim: pods replaced one at a time; got ${strategy(def)}`);
check(strategy(template(['server.modelRepository='])) === '{"maxUnavailable":0,"maxSurge":1}',
  'no claim: a new pod is ready before an old one drains');
check(strategy(template(['gpu.enabled=true', 'persistence.accessMode=ReadWriteMany'])) === '{"maxUnavailable":1,"maxSurge":0}',
  'GPU: pods replaced one at a time');
check(dep(template(['updateStrategy.type=Recreate'])).spec.strategy.type === 'Recreate', 'updateStrategy overrides');
check(strategy(template(['server.modelRepository=', 'updateStrategy.rollingUpdate.maxSurge=2'])) === '{"maxUnavailable":0,"maxSurge":2}',
  `updateStrategy.rollingUpdate's keys win over the computed ones; got ${strategy(template(['server.modelRepository=', 'updateStrategy.rollingUpdate.maxSurge=2']))}`);
check(ctr(template(['image.tag=20240101'])).image === 'collabserve:20240101', 'a whole-number image.tag renders whole');
// The server follows its token file (a Secret's update reaches the mounted file): a new
// admin.token changes the Secret, not the pod template, so no pod restarts for it.
check(JSON.stringify(dep(template(['admin.token=' + 'a'.repeat(32)])).spec.template) ===
  JSON.stringify(dep(template(['admin.token=' + 'b'.repeat(32)])).spec.template), 'a new admin.token restarts no pod');

{
  // persistence.fixOwnership: a root init container that may only chown, to the pods' user.
  check(!dep(def).spec.template.spec.initContainers, 'no init container by default');
  const fixed = template(['persistence.fixOwnership=true', 'podSecurityContext.runAsUser=2000', 'podSecurityContext.runAsGroup=3000']);
  await validateK8s(fixed, 'persistence.fixOwnership');
  const init = dep(fixed).spec.template.spec.initContainers;
  check(init && init.length === 1 && init[0].command.join(' ') ===
    'find /models ( ! -user 2000 -o ! -group 3000 ) -exec chown --no-dereference 2000:3000 {} +' &&
    init[0].securityContext.runAsUser === 0 && init[0].securityContext.capabilities.add.join(',') === 'CHOWN,DAC_OVERRIDE' && init[0].resources.limits.memory === '128Mi' &&
    init[0].volumeMounts[0].mountPath === '/models' && init[0].image === ctr(fixed).image,
    `persistence.fixOwnership chowns the repository to runAsUser:runAsGroup; got ${JSON.stringify(init)}`);
  check(!dep(template(['persistence.fixOwnership=true', 'server.modelRepository='])).spec.template.spec.initContainers,
    'no repository volume, nothing to chown');
}

// Everything on: several pods, GPU, HPA on queue time, ServiceMonitor, admin Service.
const all = template(['replicaCount=3', 'gpu.enabled=true', 'gpu.count=1', 'image.tag=0.1.0-cuda',
  'S:nodeSelector.nvidia\\.com/gpu\\.present=true', 'tolerations[0].key=nvidia.com/gpu', 'tolerations[0].operator=Exists',
  'autoscaling.enabled=true', 'autoscaling.metric=queueTime', 'autoscaling.maxReplicas=6', 'serviceMonitor.enabled=true',
  'admin.service.enabled=true', 'server.drainTimeoutS=60', 'server.flags.max_batch_size=16', 'podDisruptionBudget.minAvailable=2',
  'server.flags.max_upload_bytes=4294967296', 'server.flags.max_queue_delay_micros=1500000', 'server.flags.version_settle_s=0.5']);
await validateK8s(all, 'all options');
const ca = ctr(all);
check(ca.resources.limits['nvidia.com/gpu'] === 1, 'gpu.count=1 requests nvidia.com/gpu: 1');
check(ca.resources.limits.memory === '8Gi', 'GPU limit is added to, not replacing, the other limits');
check(dep(all).spec.template.spec.nodeSelector['nvidia.com/gpu.present'] === 'true' && dep(all).spec.template.spec.tolerations.length === 1, 'nodeSelector and tolerations reach the pod');
check(find(all, 'ConfigMap')[0].data.COLLABSERVE_DEVICE === 'cuda', 'gpu.enabled defaults the device to cuda');
check(find(all, 'ConfigMap')[0].data.COLLABSERVE_MAX_BATCH_SIZE === '16', 'server.flags.max_batch_size reaches the ConfigMap');
{
  // YAML round trips make numbers floats; the server's int64 flags must not get "4.294967296e+09".
  const data = find(all, 'ConfigMap')[0].data;
  check(data.COLLABSERVE_MAX_UPLOAD_BYTES === '4294967296' && data.COLLABSERVE_MAX_QUEUE_DELAY_MICROS === '1500000' &&
    data.COLLABSERVE_VERSION_SETTLE_S === '0.5',
    `large whole numbers reach the ConfigMap whole, fractions as they are (got ${data.COLLABSERVE_MAX_UPLOAD_BYTES}, ` +
    `${data.COLLABSERVE_MAX_QUEUE_DELAY_MICROS}, ${data.COLLABSERVE_VERSION_SETTLE_S})`);
}
check(dep(all).spec.template.metadata.annotations['checksum/config'] !== cpuChecksum, 'a flag change changes the pod template (rolls the pods)');
check(find(all, 'PersistentVolumeClaim')[0].spec.accessModes[0] === 'ReadWriteMany', 'several pods: the model claim is ReadWriteMany');
check(dep(all).spec.template.spec.terminationGracePeriodSeconds === 70, 'terminationGracePeriodSeconds follows drainTimeoutS (60 + 5 + 5)');
check(ca.livenessProbe.periodSeconds * ca.livenessProbe.failureThreshold > 65, 'liveness threshold grows with the drain timeout');
check(dep(all).spec.replicas === undefined, 'with the HPA the Deployment leaves replicas to it');
const hpa = find(all, 'HorizontalPodAutoscaler')[0];
check(hpa && hpa.spec.maxReplicas === 6 && hpa.spec.metrics[0].type === 'Pods' &&
  hpa.spec.metrics[0].pods.metric.name === 'collabserve_queue_duration_seconds_p90', 'HPA scales on the queue-time Pods metric');
check(find(all, 'ServiceMonitor')[0].spec.endpoints[0].port === 'metrics', 'ServiceMonitor scrapes the metrics port');
{
  // The alerts ask for job="collabserve": the ServiceMonitor takes the job from this Service label.
  const sm = find(all, 'ServiceMonitor')[0];
  const jobLabel = find(all, 'Service').find((x) => !x.metadata.name.endsWith('-admin')).metadata.labels[sm.spec.jobLabel];
  const alerts = fs.readFileSync(path.join(ROOT, 'deploy/prometheus/alerts.yml'), 'utf8');
  check(jobLabel === 'collabserve' && alerts.includes('up{job="collabserve"}'),
    `the ServiceMonitor's job (Service label ${sm.spec.jobLabel} = ${jobLabel}) is the one alerts.yml asks for`);
}
const adminSvc = find(all, 'Service', (s) => s.metadata.name.endsWith('-admin'))[0];
check(adminSvc && adminSvc.spec.type === 'ClusterIP' && adminSvc.spec.ports[0].targetPort === 'admin', 'admin Service is internal and targets the admin port');
check(adminSvc.spec.sessionAffinity === 'ClientIP', 'a client\'s admin calls reach the pod that holds its job');
check(find(all, 'PodDisruptionBudget')[0].spec.minAvailable === 2, 'PDB minAvailable is honoured');

// CPU autoscaling, existing claim and secret, no repository, TLS.
const ext = template(['autoscaling.enabled=true', 'persistence.existingClaim=shared-models', 'admin.existingSecret=my-admin',
  'tls.enabled=true', 'tls.secretName=cs-tls', 'admin.networkPolicy.enabled=false', 'podDisruptionBudget.enabled=false']);
await validateK8s(ext, 'existing claim/secret');
check(find(ext, 'PersistentVolumeClaim').length === 0 && find(ext, 'Secret').length === 0, 'existingClaim / existingSecret create no claim and no Secret');
const pe = dep(ext).spec.template.spec;
check(pe.volumes.some((v) => v.persistentVolumeClaim && v.persistentVolumeClaim.claimName === 'shared-models'), 'the existing claim is mounted');
check(pe.volumes.some((v) => v.secret && v.secret.secretName === 'my-admin'), 'the existing admin Secret is mounted');
check(find(ext, 'HorizontalPodAutoscaler')[0].spec.metrics[0].resource.name === 'cpu', 'HPA on CPU by default');
{
  // gRPC probes cannot speak TLS: the same health over plain HTTP on the metrics port.
  const t = ctr(ext);
  check(t.readinessProbe.httpGet.path === '/readyz' && t.readinessProbe.httpGet.port === 'metrics' &&
    t.livenessProbe.httpGet.path === '/livez' && t.startupProbe.httpGet.path === '/readyz' && !t.readinessProbe.grpc,
    'with TLS the probes ask /readyz and /livez on the metrics port');
  check(ctr(template(['tls.enabled=true', 'tls.secretName=t', 'probes.readiness.service=demo'])).readinessProbe.httpGet.path === '/readyz/demo',
    'with TLS, probes.readiness.service is /readyz/<model>');
}
check(find(ext, 'ConfigMap')[0].data.COLLABSERVE_TLS_CERT === '/etc/collabserve/tls/tls.crt', 'TLS flags point at the mounted Secret');
check(find(ext, 'ConfigMap')[0].data.COLLABSERVE_TLS_CLIENT_CA === undefined, 'no client certificates asked for by default');
{
  // Mutual TLS: the CA from the TLS Secret itself (cert-manager's ca.crt), or from a Secret of its own.
  const same = template(['tls.enabled=true', 'tls.secretName=cs-tls', 'tls.clientCA.enabled=true']);
  await validateK8s(same, 'mutual TLS, CA in the TLS Secret');
  check(find(same, 'ConfigMap')[0].data.COLLABSERVE_TLS_CLIENT_CA === '/etc/collabserve/tls/ca.crt' &&
    !dep(same).spec.template.spec.volumes.some((v) => v.name === 'client-ca'),
    'tls.clientCA from the TLS Secret: its ca.crt, no second volume');
  check(ctr(same).args.some((a) => a.includes('tls_client_ca')), 'the container passes --tls_client_ca');
  check(notes(['tls.enabled=true', 'tls.secretName=t', 'tls.clientCA.enabled=true']).includes('--tls --tls_client_cert=CLIENT.crt --tls_client_key=CLIENT.key health'),
    'NOTES: collabctl with a client certificate under mutual TLS');
  const named = template(['tls.enabled=true', 'tls.secretName=cs-tls', 'tls.clientCA.enabled=true', 'tls.clientCA.secretName=cs-tls']);
  check(find(named, 'ConfigMap')[0].data.COLLABSERVE_TLS_CLIENT_CA === '/etc/collabserve/tls/ca.crt' &&
    !dep(named).spec.template.spec.volumes.some((v) => v.name === 'client-ca'),
    'tls.clientCA.secretName naming the TLS Secret itself: no second volume');
  const own = template(['tls.enabled=true', 'tls.secretName=cs-tls', 'tls.clientCA.enabled=true',
    'tls.clientCA.secretName=clients', 'tls.clientCA.key=bundle.pem']);
  await validateK8s(own, 'mutual TLS, CA in a Secret of its own');
  const v = dep(own).spec.template.spec.volumes.find((x) => x.name === 'client-ca');
  check(v && v.secret.secretName === 'clients' && ctr(own).volumeMounts.some((m) => m.name === 'client-ca' && m.mountPath === '/etc/collabserve/client-ca'),
    'tls.clientCA.secretName is mounted on its own');
  check(find(own, 'ConfigMap')[0].data.COLLABSERVE_TLS_CLIENT_CA === '/etc/collabserve/client-ca/bundle.pem', 'tls.clientCA.key names the file');
}
check(find(ext, 'NetworkPolicy').length === 0 && find(ext, 'PodDisruptionBudget').length === 0, 'NetworkPolicy and PDB can be turned off');
const demo = template(['server.modelRepository=']);
check(!ctr(demo).args.some((a) => a.includes('model_repository')) && find(demo, 'PersistentVolumeClaim').length === 0,
  'an empty modelRepository serves the demo model: no flag, no claim');

// An existing claim keeps its access mode (the API refuses a change): `lookup`, which helm template
// cannot answer, is replaced in a copy of the chart by the claim a cluster would return.
function withExistingClaim(mode, sets) {
  const dir = path.join(tmpdir(`claim-${mode}`), 'collabserve');
  fs.cpSync(chart, dir, { recursive: true });
  const helpers = path.join(dir, 'templates/_helpers.tpl');
  const text = fs.readFileSync(helpers, 'utf8');
  const call = 'lookup "v1" "PersistentVolumeClaim" .Release.Namespace (include "collabserve.pvcName" .)';
  check(text.includes(call), '_helpers.tpl looks the claim up');
  fs.writeFileSync(helpers, text.replace(call, `dict "spec" (dict "accessModes" (list "${mode}"))`));
  const args = ['template', 'cs', dir, '--namespace', 'ml'];
  for (const x of sets) args.push('--set', x);
  return run(helm, args, { env });
}
{
  const scaled = withExistingClaim('ReadWriteOnce', ['replicaCount=3']);
  check(scaled.status !== 0 && scaled.stderr.includes('the model repository claim cs-collabserve-models is ReadWriteOnce') &&
    scaled.stderr.includes('persistence.existingClaim'),
    `scaling out on an existing ReadWriteOnce claim is refused, saying how to move on; got: ${scaled.stderr.trim().slice(0, 300)}`);
  const one = withExistingClaim('ReadWriteOnce', []);
  check(one.status === 0 && find(parseDocs(one.stdout, 'existing RWO claim'), 'PersistentVolumeClaim')[0].spec.accessModes[0] === 'ReadWriteOnce',
    'one pod on an existing ReadWriteOnce claim renders it unchanged');
  const shared = withExistingClaim('ReadWriteMany', ['replicaCount=3']);
  check(shared.status === 0 && find(parseDocs(shared.stdout, 'existing RWX claim'), 'PersistentVolumeClaim')[0].spec.accessModes[0] === 'ReadWriteMany',
    'several pods on an existing ReadWriteMany claim render');
  const rwoThenMany = withExistingClaim('ReadWriteMany', []);
  check(rwoThenMany.status === 0 && strategy(parseDocs(rwoThenMany.stdout, 'existing RWX claim, one pod')) === '{"maxUnavailable":0,"maxSurge":1}',
    'a ReadWriteMany claim lets a rollout surge');
}

// Bad values fail with a message that names the value.
for (const [sets, want] of [[['server.adminPort=8500'], 'server.adminPort'], [['tls.enabled=true'], 'tls.secretName'],
  [['server.httpPort=9090'], 'server.httpPort must differ'], [['server.httpPort=-1'], 'httpPort'],
  [['service.httpPort=8500'], 'service.httpPort must differ'],
  [['tls.clientCA.enabled=true'], 'tls.clientCA.enabled (mutual TLS) needs tls.enabled'],
  [['tls.enabled=true', 'tls.secretName=t', 'tls.clientCA.enabled=true', 'tls.clientCA.key='], 'tls.clientCA.key: name the key'],
  [['autoscaling.enabled=true', 'autoscaling.metric=memory'], 'autoscaling.metric'],
  // values.schema.json: a misspelt flag, a wrong type, a bad device are refused at install.
  [['server.flags.max_batch_sise=8'], 'max_batch_sise'], [['replicaCount=three'], 'replicaCount'],
  // A number would be printed as YAML reads it: 1.10 as "1.1".
  [['J:image.tag=1.10'], 'image.tag'],
  [['server.device=gpu'], 'server.device'], [['gpu.enabeld=true'], 'gpu.enabeld'.split('.')[1]],
  // One GPU per pod: the server drives one (--device).
  [['gpu.enabled=true', 'gpu.count=2'], 'gpu.count']]) {
  const r = template(sets, { expectFail: true });
  check(r.status !== 0 && r.stderr.includes(want), `helm template --set ${sets.join(',')} fails naming ${want}; got: ${r.stderr.trim().slice(0, 200)}`);
}

// Every .Values path used in a template exists in values.yaml; every value is used, documented, in README.
const values = YAML.parse(fs.readFileSync(path.join(chart, 'values.yaml'), 'utf8'));
const tdir = path.join(chart, 'templates');
const used = new Set();
for (const f of fs.readdirSync(tdir)) {
  const text = fs.readFileSync(path.join(tdir, f), 'utf8');
  for (const m of text.matchAll(/\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)/g)) {
    const p = m[1].slice(1);
    used.add(p);
    let v = values;
    for (const k of p.split('.')) v = v && typeof v === 'object' ? v[k] : undefined;
    check(v !== undefined, `templates/${f} uses .Values.${p}, which values.yaml does not define`);
  }
}
const readme = fs.readFileSync(path.join(chart, 'README.md'), 'utf8');
for (const row of valuesDoc(path.join(chart, 'values.yaml'))) {
  check(row.comment.length > 0, `values.yaml: ${row.key} has no comment`);
  check(readme.includes(`| \`${row.key}\` |`), `README.md: no table row for ${row.key} (regenerate with node tests/deploy/values-doc.mjs)`);
  const isUsed = [...used].some((u) => u === row.key || u.startsWith(row.key + '.') || row.key.startsWith(u + '.'));
  check(isUsed, `values.yaml: ${row.key} is used by no template`);
}
// README.md's table is values-doc.mjs's output row for row: a hand edit would be lost when it is
// regenerated, so the fix belongs in values.yaml's comment.
for (const line of markdownTable(valuesDoc(path.join(chart, 'values.yaml'))).split('\n').slice(2)) {
  check(readme.includes(line), `README.md: the row differs from values.yaml (regenerate with node tests/deploy/values-doc.mjs):\n  ${line}`);
}

// Every server flag can be set from values: the chart sets some from their own values, every other
// one is a server.flags key that the schema accepts, documented with the server's default.
const table = run('/usr/bin/python3', [path.join(ROOT, 'scripts/flag-table.py')]);
if (table.status !== 0) fatal(`scripts/flag-table.py failed:\n${table.stderr}`);
const serverFlags = new Map([...table.stdout.matchAll(/^\| `--(\w+)` \| [^|]+ \| ([^|]+?) \|/gm)].map((m) => [m[1], m[2].replace(/^"(.*)"$/, '$1')]));
check(serverFlags.size > 30, `scripts/flag-table.py lists the server's flags; got ${serverFlags.size}`);
const fromOwnValues = new Set(['port', 'admin_port', 'metrics_port', 'http_port', 'drain_timeout_s', 'device', 'model_repository',
  'admin_token_file', 'tls_cert', 'tls_key', 'tls_client_ca']);
const throughExtraArgs = new Set(['v', 'vmodule']);  // glog's verbose log: server.extraArgs' example
const schema = JSON.parse(fs.readFileSync(path.join(chart, 'values.schema.json'), 'utf8'));
const schemaFlags = Object.keys(schema.properties.server.properties.flags.properties).sort();
const valueFlags = Object.keys(values.server.flags).sort();
check(JSON.stringify(schemaFlags) === JSON.stringify(valueFlags),
  `values.schema.json's server.flags (${schemaFlags}) are values.yaml's (${valueFlags})`);
const docs = new Map(valuesDoc(path.join(chart, 'values.yaml')).map((r) => [r.key, r.comment.replace(/\s+/g, ' ')]));
check(values.server.extraArgs !== undefined && docs.get('server.extraArgs').includes('--v=1'), 'server.extraArgs shows --v=1');
for (const [flag, dflt] of serverFlags) {
  if (fromOwnValues.has(flag) || throughExtraArgs.has(flag)) continue;
  check(valueFlags.includes(flag), `server flag --${flag} has no server.flags.${flag} in values.yaml (and the schema)`);
  const doc = docs.get(`server.flags.${flag}`);
  check(!doc || doc.includes(`(server default ${dflt})`),
    `values.yaml: server.flags.${flag}'s comment should end "(server default ${dflt})"; it reads: ${doc}`);
}
for (const flag of valueFlags) check(serverFlags.has(flag), `values.yaml: server.flags.${flag} is not a server flag`);
for (const flag of [...fromOwnValues, ...throughExtraArgs]) check(serverFlags.has(flag), `--${flag} is not a server flag`);

check(fs.existsSync(path.join(tdir, 'NOTES.txt')) && fs.existsSync(path.join(tdir, '_helpers.tpl')), 'templates/NOTES.txt and _helpers.tpl exist');
finish('deploy_helm');
