{{/* Name of the chart, overridable. */}}
{{- define "easerve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Full name: the release name, plus the chart name unless the release name contains it. */}}
{{- define "easerve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 52 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "easerve.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "easerve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: easerve
{{- end -}}

{{- define "easerve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "easerve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "easerve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "easerve.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespace the operator watches in scope=namespace mode. */}}
{{- define "easerve.watchNamespace" -}}
{{- default .Release.Namespace .Values.watchNamespace -}}
{{- end -}}

{{- define "easerve.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{/*
The rules the operator needs on its namespaced objects, shared by the ClusterRole (scope=cluster)
and the Role (scope=namespace). Exact verbs and resources, no wildcards (docs/helm.md says why each).
*/}}
{{- define "easerve.namespacedRules" -}}
- apiGroups: ["easerve.io"]
  resources: ["epddeployments"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["easerve.io"]
  resources: ["epddeployments/status"]
  verbs: ["get", "patch", "update"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "update", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list"]  # unbound pods of a not-Ready EPDDeployment (InsufficientCapacity); pods are not watched
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]  # HAS on the cluster: the load and profiling Jobs' reports
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "patch", "delete"]  # HAS on the cluster: load and profiling Jobs
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}

{{/* Cluster-scoped rules needed in both modes. */}}
{{- define "easerve.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- if eq .Values.scope "namespace" }}
# kopf watches Namespace objects when it serves a list of namespaces (read-only)
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["get", "list", "watch"]
{{- end }}
{{- if .Values.webhook.enabled }}
- apiGroups: ["admissionregistration.k8s.io"]
  resources: ["validatingwebhookconfigurations", "mutatingwebhookconfigurations"]
  verbs: ["get", "list", "watch", "create", "patch"]
{{- end }}
{{- end -}}

{{/* The etcd endpoints the operator passes into serving pods (empty: none configured). */}}
{{- define "easerve.discoveryEtcdEndpoints" -}}
{{- if .Values.discovery.etcd.endpoints -}}
{{- .Values.discovery.etcd.endpoints -}}
{{- else if .Values.discovery.etcd.install -}}
{{- printf "http://%s-etcd.%s.svc:2379" (include "easerve.fullname" .) .Release.Namespace -}}
{{- end -}}
{{- end -}}
