{{/*
Names, labels and the few decisions more than one template needs, made once here.
*/}}

{{- define "ekp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ekp.fullname" -}}
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

{{- define "ekp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ekp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ekp.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "ekp.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: node-proxy
{{- end }}

{{- define "ekp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "ekp.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ekp.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The cleanup-kube-proxy init container: off unless asked for (null or false), in eBPF mode only.
The agent itself removes kube-proxy's rules and tables once its programs serve, after carrying their
established flows over (agent/takeover/into_ebpf.py); removing them before the agent starts would
break every new connection until it serves, and with nftables the established ones too. In
iptables mode the agent's own chains are kube-proxy's (same names): the init container would delete
the live rules at every pod restart, so it is refused there. */}}
{{- define "ekp.cleanupKubeProxy" -}}
{{- if .Values.cleanupKubeProxy.enabled }}
{{- if ne .Values.mode "ebpf" }}
{{- fail "cleanupKubeProxy.enabled=true needs mode=ebpf: in iptables mode the agent writes kube-proxy's own KUBE-* chains (it takes kube-proxy's over), and the init container would delete them at every restart of the pod" }}
{{- end }}true
{{- end }}
{{- end }}

{{/* The metrics Service exists for the Service itself or for a ServiceMonitor. */}}
{{- define "ekp.metricsService" -}}
{{- if or .Values.metrics.service.enabled .Values.metrics.serviceMonitor.enabled }}true{{ end }}
{{- end }}

{{/* Where the metrics server binds: given, else 0.0.0.0 when Prometheus must reach it, else
kube-proxy's 127.0.0.1. */}}
{{- define "ekp.metricsHost" -}}
{{- if .Values.metrics.host }}
{{- .Values.metrics.host }}
{{- else if include "ekp.metricsService" . }}0.0.0.0
{{- else }}127.0.0.1
{{- end }}
{{- end }}

{{- define "ekp.ebpf" -}}
{{- if eq .Values.mode "ebpf" }}true{{ end }}
{{- end }}

{{/* The agent container's securityContext: explicit capabilities, or privileged. */}}
{{- define "ekp.securityContext" -}}
{{- if .Values.securityContext.privileged }}
privileged: true
{{- else }}
privileged: false
allowPrivilegeEscalation: false
capabilities:
  drop: [ALL]
  add:
    {{- toYaml (get .Values.securityContext.capabilities .Values.mode) | nindent 4 }}
    {{- if and (not (include "ekp.ebpf" .)) .Values.takeOverFromEbpf }}
    - BPF
    {{- end }}
{{- end }}
readOnlyRootFilesystem: true
runAsUser: 0
runAsGroup: 0
runAsNonRoot: false
seccompProfile:
{{- if .Values.securityContext.seccompProfile }}
  {{- toYaml .Values.securityContext.seccompProfile | nindent 2 }}
{{- else if or (include "ekp.ebpf" .) .Values.securityContext.privileged .Values.takeOverFromEbpf }}
  type: Unconfined
{{- else }}
  type: RuntimeDefault
{{- end }}
{{- end }}
