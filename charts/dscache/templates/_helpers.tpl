{{/* Chart name. */}}
{{- define "dscache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: release-chart unless the release name already contains the chart name. */}}
{{- define "dscache.fullname" -}}
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

{{/* chart-version label value. */}}
{{- define "dscache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: name and instance only. */}}
{{- define "dscache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dscache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* Labels of every object, but the component. */}}
{{- define "dscache.commonLabels" -}}
helm.sh/chart: {{ include "dscache.chart" . }}
{{ include "dscache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dscache
{{- end }}

{{/* Common labels (the operator's objects). */}}
{{- define "dscache.labels" -}}
{{ include "dscache.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/* ServiceAccount name. */}}
{{- define "dscache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "dscache.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The rules the operator needs on the resources it manages, in a watched namespace. */}}
{{- define "dscache.namespacedRules" -}}
- apiGroups: ["dscache.io"]
  resources: ["deepseekcachedeployments"]
  verbs: ["get", "list", "watch", "patch", "update"]
- apiGroups: ["dscache.io"]
  resources: ["deepseekcachedeployments/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  # create only: a generated tenant salt, created once and never read back (the
  # kubelet hands it to the model pods). No get, list, watch or patch.
  verbs: ["create"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: [""]
  resources: ["pods"]
  # patch: an annotation on live router pods after a router config change, so the
  # kubelet refreshes the ConfigMap volume at once (never a spec field).
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  # The prewarm Job is created once per revision and never changed.
  verbs: ["get", "list", "watch", "create"]
- apiGroups: ["monitoring.coreos.com"]
  resources: ["servicemonitors", "prometheusrules"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["inference.networking.k8s.io"]
  # routing.gateway inferencePool: the resource's InferencePool (its endpoint picker is
  # the router pods' picker).
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch"]
- apiGroups: ["inference.networking.x-k8s.io"]
  # Its InferenceObjectives' priorities (read only, kept in a kopf index from a watch): a
  # sheddable objective's requests get 429 from the endpoint picker when every pod is at
  # its bound.
  resources: ["inferenceobjectives"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/* Rules of kopf's peering, where the peering objects live: keep-alives are patches. */}}
{{- define "dscache.peeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: [{{ . | quote }}]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* The shared-tier Secret that DeepSeekCacheDeployments name in spec.cache.shared.secretRef. */}}
{{- define "dscache.sharedTierSecretName" -}}
{{- if .Values.sharedTier.existingSecret }}
{{- .Values.sharedTier.existingSecret }}
{{- else }}
{{- printf "%s-shared-tier" (include "dscache.fullname" .) }}
{{- end }}
{{- end }}

{{/* Namespaces of the shared-tier Secret: sharedTier.namespaces, else the release's. */}}
{{- define "dscache.sharedTierNamespaces" -}}
{{- join "," (.Values.sharedTier.namespaces | default (list .Release.Namespace)) }}
{{- end }}
