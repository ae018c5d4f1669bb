{{/* Chart name, truncated for label values. */}}
{{- define "glmflash.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Fully qualified operator name. */}}
{{- define "glmflash.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-operator" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "glmflash.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "glmflash.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "glmflash.selectorLabels" -}}
app.kubernetes.io/name: glmflash-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "glmflash.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "glmflash.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The activator's name. */}}
{{- define "glmflash.activatorName" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- printf "%s-activator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s-activator" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The activator's selector labels: apart from the operator's, whose Deployment must not select its pods. */}}
{{- define "glmflash.activatorSelectorLabels" -}}
app.kubernetes.io/name: glmflash-activator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "glmflash.activatorLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "glmflash.activatorSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}
