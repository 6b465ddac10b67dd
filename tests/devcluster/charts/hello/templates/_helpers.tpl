{{- define "hello.fullname" -}}
{{- printf "%s-hello" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "hello.selectorLabels" -}}
app.kubernetes.io/name: hello
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}
