// deploy_kustomize: the kustomize base and the GPU overlay render with kubectl kustomize, validate
// against the Kubernetes schemas, and the overlay changes what it says it changes.
import path from 'node:path';
import { ROOT, check, fatal, finish, k8sTools, run, parseDocs, validateK8s, find } from './lib.mjs';

const { kubectl } = k8sTools();
function render(dir) {
  const r = run(kubectl, ['kustomize', path.join(ROOT, dir)]);
  if (r.status !== 0) fatal(`kubectl kustomize ${dir} failed:\n${r.stderr}`);
  return parseDocs(r.stdout, dir);
}
const base = render('deploy/kustomize/base');
const gpu = render('deploy/kustomize/overlays/gpu');
await validateK8s(base, 'base');
await validateK8s(gpu, 'overlays/gpu');
for (const [name, objs] of [['base', base], ['gpu', gpu]]) {
  const kinds = objs.map((o) => o.kind).sort().join(',');
  check(kinds === 'ConfigMap,Deployment,PersistentVolumeClaim,Service', `${name}: renders ConfigMap, Deployment, PVC, Service; got ${kinds}`);
  const d = find(objs, 'Deployment')[0];
  const pod = d.spec.template.spec;
  const c = pod.containers[0];
  const sel = d.spec.selector.matchLabels;
  check(sel && Object.entries(sel).every(([k, v]) => d.spec.template.metadata.labels[k] === v), `${name}: the selector matches the pod labels`);
  check(find(objs, 'Service')[0].spec.selector['app.kubernetes.io/name'] === 'collabserve', `${name}: the Service selects the pods`);
  // One pod on a ReadWriteOnce claim (or a GPU): a surged pod could not start beside the old one.
  check(d.spec.strategy.rollingUpdate.maxSurge === 0 && find(objs, 'PersistentVolumeClaim')[0].spec.accessModes[0] === 'ReadWriteOnce',
    `${name}: a rollout replaces the pod on its ReadWriteOnce claim instead of surging`);
  const cm = find(objs, 'ConfigMap')[0];
  check(c.envFrom[0].configMapRef.name === cm.metadata.name, `${name}: the container reads the ConfigMap`);
  // $(VAR): from the ConfigMap, or from the container's own env (the CPU request, for --cpus).
  const env = new Set((c.env || []).map((e) => e.name));
  for (const a of c.args) {
    for (const [, v] of a.matchAll(/\$\((\w+)\)/g)) check(v in cm.data || env.has(v), `${name}: arg ${a} references ${v}, missing from the ConfigMap`);
  }
  const cpus = (c.env || []).find((e) => e.name === 'COLLABSERVE_CPUS');
  check(cpus && cpus.valueFrom.resourceFieldRef.resource === 'requests.cpu' && c.args.includes('--cpus=$(COLLABSERVE_CPUS)'),
    `${name}: --cpus is the container's CPU request (no CPU limit: the server would see the node)`);
  check(['startupProbe', 'readinessProbe', 'livenessProbe'].every((p) => c[p].grpc && c[p].grpc.port === 8500), `${name}: gRPC probes`);
  const drain = Number(cm.data.COLLABSERVE_DRAIN_TIMEOUT_S);
  const preStop = Number(c.lifecycle.preStop.exec.command[1]);
  check(pod.terminationGracePeriodSeconds > drain + preStop, `${name}: terminationGracePeriodSeconds > drain + preStop`);
  check(c.livenessProbe.periodSeconds * c.livenessProbe.failureThreshold > drain + preStop, `${name}: liveness tolerates a drain`);
  check(pod.securityContext.runAsNonRoot && c.securityContext.readOnlyRootFilesystem, `${name}: non-root, read-only root filesystem`);
  check(pod.volumes.some((v) => v.persistentVolumeClaim && v.persistentVolumeClaim.claimName === find(objs, 'PersistentVolumeClaim')[0].metadata.name), `${name}: the model claim is mounted`);
}
const gc = find(gpu, 'Deployment')[0].spec.template.spec;
check(gc.containers[0].resources.limits['nvidia.com/gpu'] === 1, 'gpu: requests one nvidia.com/gpu');
check(gc.containers[0].image.endsWith('-cuda'), `gpu: uses the CUDA image, got ${gc.containers[0].image}`);
check(find(gpu, 'ConfigMap')[0].data.COLLABSERVE_DEVICE === 'cuda', 'gpu: --device=cuda');
check(gc.tolerations && gc.nodeSelector, 'gpu: tolerations and nodeSelector for GPU nodes');
check(find(base, 'Deployment')[0].spec.template.spec.containers[0].image === 'collabserve:0.1.0', 'base: CPU image');
check(find(base, 'ConfigMap')[0].data.COLLABSERVE_DEVICE === 'cpu', 'base: --device=cpu');
finish('deploy_kustomize');
