{{/* The release's base name for every object. */}}
{{- define "tandem.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "tandem.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one role: (dict "ctx" $ "role" "decode"). */}}
{{- define "tandem.selector" -}}
app.kubernetes.io/name: {{ .ctx.Chart.Name }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .role }}
{{- end -}}

{{- define "tandem.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tandem.kvSecretName" -}}
{{- .Values.kvSecret.existingSecret | default (printf "%s-kv" (include "tandem.fullname" .)) -}}
{{- end -}}

{{- define "tandem.modelClaim" -}}
{{- .Values.model.cache.existingClaim | default (printf "%s-models" (include "tandem.fullname" .)) -}}
{{- end -}}

{{/* The SRV name of a worker group's headless Service (its port is named grpc). */}}
{{- define "tandem.srv" -}}
_grpc._tcp.{{ include "tandem.fullname" .ctx }}-{{ .role }}.{{ .ctx.Release.Namespace }}.svc.cluster.local
{{- end -}}

{{/* Environment every role shares: the model cache and the OTLP exporter. */}}
{{- define "tandem.commonEnv" -}}
- name: TANDEM_MODEL
  value: {{ printf "/models/%s" .ctx.Values.model.file | quote }}
- name: TANDEM_LOG
  value: info
{{- with .ctx.Values.otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ . | quote }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $.ctx.Values.otel.sampler | quote }}
{{- with $.ctx.Values.otel.samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ . | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{/* The Secret holding the router's tenants.yaml: the given one, the chart's made from
router.tenants.list, or empty (no tenants). */}}
{{- define "tandem.tenantsSecretName" -}}
{{- if .Values.router.tenants.existingSecret -}}
{{- .Values.router.tenants.existingSecret -}}
{{- else if .Values.router.tenants.list -}}
{{- printf "%s-tenants" (include "tandem.fullname" .) -}}
{{- end -}}
{{- end -}}
