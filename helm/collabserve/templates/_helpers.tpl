{{/* Chart name, truncated to the 63 characters Kubernetes allows in a label value. */}}
{{- define "collabserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart, unless the release name already contains the chart name. */}}
{{- define "collabserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "collabserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels (https://kubernetes.io/docs/concepts/overview/working-with-objects/common-labels/). */}}
{{- define "collabserve.labels" -}}
helm.sh/chart: {{ include "collabserve.chart" . }}
{{ include "collabserve.selectorLabels" . }}
app.kubernetes.io/version: {{ (default .Chart.AppVersion .Values.image.tag) | toString | trunc 63 | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: collabserve
{{- end }}

{{/* Selector labels: must never change between upgrades. */}}
{{- define "collabserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "collabserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "collabserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "collabserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image.tag, else the appVersion: "0.1.0" for the CPU image, "0.1.0-cuda" with gpu.enabled. */}}
{{- define "collabserve.image" -}}
{{- $tag := .Values.image.tag | toString }}
{{- if not $tag }}{{ $tag = printf "%s%s" .Chart.AppVersion (ternary "-cuda" "" (.Values.gpu.enabled | default false)) }}{{ end }}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* Most pods that may run at once: decides the access mode of the model repository claim. */}}
{{- define "collabserve.maxPods" -}}
{{- if .Values.autoscaling.enabled }}{{ int .Values.autoscaling.maxReplicas }}{{ else }}{{ int .Values.replicaCount }}{{ end }}
{{- end }}

{{/* persistence.accessMode; else the mode of the claim as it exists in the cluster (a bound claim's
     access modes cannot change, so a scale-out must not ask for another); else ReadWriteMany when
     several pods share the repository, ReadWriteOnce otherwise. */}}
{{- define "collabserve.pvcAccessMode" -}}
{{- $existing := lookup "v1" "PersistentVolumeClaim" .Release.Namespace (include "collabserve.pvcName" .) }}
{{- if .Values.persistence.accessMode }}
{{- .Values.persistence.accessMode }}
{{- else if and $existing $existing.spec $existing.spec.accessModes }}
{{- $mode := first $existing.spec.accessModes }}
{{- if and (gt (int (include "collabserve.maxPods" .)) 1) (ne $mode "ReadWriteMany") }}
{{- fail (printf "the model repository claim %s is %s, so more than one pod cannot mount it (replicaCount / autoscaling.maxReplicas): move the models to a ReadWriteMany claim (persistence.existingClaim) or keep one pod" (include "collabserve.pvcName" .) $mode) }}
{{- end }}
{{- $mode }}
{{- else if gt (int (include "collabserve.maxPods" .)) 1 }}
{{- "ReadWriteMany" }}
{{- else }}
{{- "ReadWriteOnce" }}
{{- end }}
{{- end }}

{{- define "collabserve.pvcName" -}}
{{- default (printf "%s-models" (include "collabserve.fullname" .)) .Values.persistence.existingClaim }}
{{- end }}

{{- define "collabserve.adminSecretName" -}}
{{- default (printf "%s-admin" (include "collabserve.fullname" .)) .Values.admin.existingSecret }}
{{- end }}

{{/* Device flag: explicit server.device, else cuda with GPUs, else cpu. */}}
{{- define "collabserve.device" -}}
{{- if .Values.server.device }}{{ .Values.server.device }}{{ else if .Values.gpu.enabled }}cuda{{ else }}cpu{{ end }}
{{- end }}

{{/* Pod terminationGracePeriodSeconds = drain timeout + preStop sleep + margin. */}}
{{- define "collabserve.terminationGracePeriodSeconds" -}}
{{- add (int .Values.server.drainTimeoutS) (int .Values.terminationGracePeriod.preStopSleepSeconds) (int .Values.terminationGracePeriod.marginSeconds) }}
{{- end }}

{{/* Liveness failureThreshold, raised so that a whole drain (NOT_SERVING) never triggers a restart. */}}
{{- define "collabserve.livenessFailureThreshold" -}}
{{- $period := max 1 (int .Values.probes.liveness.periodSeconds) }}
{{- $drain := add (int .Values.server.drainTimeoutS) (int .Values.terminationGracePeriod.preStopSleepSeconds) }}
{{- $needed := add (div (add $drain (sub $period 1)) $period) 1 }}
{{- max (int .Values.probes.liveness.failureThreshold) $needed }}
{{- end }}

{{/* Server flags as an ordered dict name -> value (only non-empty ones). The ConfigMap stores them
     and the container's args reference them, so both are rendered from this one list. */}}
{{- define "collabserve.flags" -}}
{{- $f := dict "port" .Values.server.port "admin_port" .Values.server.adminPort "metrics_port" .Values.server.metricsPort "http_port" (ternary -1 .Values.server.httpPort (eq (int .Values.server.httpPort) 0)) "drain_timeout_s" .Values.server.drainTimeoutS "device" (include "collabserve.device" .) "admin_token_file" "/etc/collabserve/admin/token" }}
{{- if .Values.server.modelRepository }}
{{- $_ := set $f "model_repository" .Values.server.modelRepository }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $_ := set $f "tls_cert" "/etc/collabserve/tls/tls.crt" }}
{{- $_ := set $f "tls_key" "/etc/collabserve/tls/tls.key" }}
{{- if .Values.tls.clientCA.enabled }}
{{- $_ := set $f "tls_client_ca" (include "collabserve.clientCAPath" .) }}
{{- end }}
{{- end }}
{{- range $k, $v := .Values.server.flags }}
{{- if ne (toString $v) "" }}
{{- $_ := set $f $k $v }}
{{- end }}
{{- end }}
{{- toYaml $f }}
{{- end }}

{{/* A flag's value as the server parses it. The flags pass through toYaml | fromYaml, which makes
     every number a float64, and toString prints 4294967296 as "4.294967296e+09": whole numbers
     are printed whole; everything else as it is. */}}
{{- define "collabserve.flagValue" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) -}}
{{- int64 . -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end }}

{{/* Environment variable that carries a flag from the ConfigMap: max_batch_size -> COLLABSERVE_MAX_BATCH_SIZE. */}}
{{- define "collabserve.flagEnv" -}}
{{- printf "COLLABSERVE_%s" (. | upper | replace "-" "_") }}
{{- end }}

{{/* "true" when a rollout cannot start a new pod beside the old one: it waits for a GPU, or mounts a
     model claim that is not ReadWriteMany (a ReadWriteOnce volume attaches to one node only). */}}
{{- define "collabserve.surgeBlocked" -}}
{{- $claim := and .Values.server.modelRepository .Values.persistence.enabled }}
{{- if or .Values.gpu.enabled (and $claim (ne (include "collabserve.pvcAccessMode" .) "ReadWriteMany")) }}true{{ end }}
{{- end }}

{{/* "true" when --cpus comes from the container's CPU request (server.flags.cpus empty, a request set). */}}
{{- define "collabserve.cpusFromRequest" -}}
{{- if and (eq (toString .Values.server.flags.cpus) "") .Values.resources.requests .Values.resources.requests.cpu }}true{{ end }}
{{- end }}

{{/* Mutual TLS: the client CA file. In the TLS Secret's own mount when it is that Secret, else in
     a volume of its own. */}}
{{- define "collabserve.clientCAOwnVolume" -}}
{{- $name := .Values.tls.clientCA.secretName | default .Values.tls.secretName }}
{{- if ne $name .Values.tls.secretName }}true{{ end }}
{{- end }}
{{- define "collabserve.clientCAPath" -}}
{{- if include "collabserve.clientCAOwnVolume" . -}}
/etc/collabserve/client-ca/{{ .Values.tls.clientCA.key }}
{{- else -}}
/etc/collabserve/tls/{{ .Values.tls.clientCA.key }}
{{- end }}
{{- end }}
