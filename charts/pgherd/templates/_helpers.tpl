{{/*
Name of the chart, shortened to fit a label value.
*/}}
{{- define "pgherd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Base name of the release's objects: <release>-pgherd, or just <release> when it already says pgherd.
Truncated so that the longest suffix ("-leader-election") still fits the 63 characters of a label.
*/}}
{{- define "pgherd.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 47 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 47 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "pgherd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that select the operator pods. Never change them: a Deployment's selector is immutable.
*/}}
{{- define "pgherd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pgherd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "pgherd.labels" -}}
helm.sh/chart: {{ include "pgherd.chart" . }}
{{ include "pgherd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pgherd
{{- end }}

{{/*
The operator's ServiceAccount.
*/}}
{{- define "pgherd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pgherd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pgherd.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
Image of the PostgreSQL pods and backup Jobs: the pgherd image itself, which carries every major, by
default; "{major}" in a given one is replaced by the operator with a cluster's postgresVersion.
*/}}
{{- define "pgherd.postgresImage" -}}
{{- if .Values.postgresImage }}
{{- .Values.postgresImage }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{- define "pgherd.leaseName" -}}
{{- default (printf "%s-leader" (include "pgherd.fullname" .)) .Values.leaderElection.leaseName }}
{{- end }}

{{/*
Refuse configurations that render but cannot work. values.schema.json refuses most of them first;
these messages are the ones a person sees when the schema cannot express the rule.
*/}}
{{- define "pgherd.validate" -}}
{{- if and .Values.podDisruptionBudget.enabled (gt (int .Values.replicas) 1) (ge (int .Values.podDisruptionBudget.minAvailable) (int .Values.replicas)) }}
{{- fail (printf "podDisruptionBudget.minAvailable (%d) must be lower than replicas (%d), or no operator pod could ever be evicted and node drains would hang" (int .Values.podDisruptionBudget.minAvailable) (int .Values.replicas)) }}
{{- end }}
{{- end }}

{{/*
The rights the operator needs on namespaced objects, in the watched namespaces (a ClusterRole, or a
Role per watched namespace): exactly the verbs it uses, each one seen in the API server's audit log of
the e2e suite (e2e/test_kube_operations.py checks both ways). docs/rbac.md explains every rule, and
tests/chart checks the two agree.
*/}}
{{- define "pgherd.namespacedRules" -}}
- apiGroups: ["pgherd.io"]
  resources: ["postgresclusters", "backups", "restores"]
  verbs: ["list", "watch"]
- apiGroups: ["pgherd.io"]
  resources: ["postgresclusters"]
  verbs: ["get", "patch"]
- apiGroups: ["pgherd.io"]
  resources: ["backups"]
  verbs: ["get", "create"]
- apiGroups: ["pgherd.io"]
  resources: ["postgresclusters/status", "backups/status", "restores/status"]
  verbs: ["patch"]
- apiGroups: ["pgherd.io"]
  resources: ["postgresclusters/finalizers"]
  verbs: ["update"]
- apiGroups: ["apps"]
  resources: ["statefulsets"]
  verbs: ["create", "get", "list", "watch", "patch"]
- apiGroups: [""]
  resources: ["services", "configmaps", "serviceaccounts"]
  verbs: ["create", "patch"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "update"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["create", "get", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["create", "list", "watch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "patch", "delete"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["list", "watch", "patch", "delete"]
- apiGroups: ["discovery.k8s.io"]
  resources: ["endpointslices"]
  verbs: ["create", "list", "watch", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/*
Roles in each watched namespace instead of a ClusterRole: the default whenever watchNamespaces is set
(rbac.namespaced: false keeps one ClusterRole). An operator serving all namespaces needs a ClusterRole.
*/}}
{{- define "pgherd.rbacNamespaced" -}}
{{- if and .Values.rbac.namespaced .Values.watchNamespaces }}true{{ end }}
{{- end }}

{{/*
Rights on cluster-scoped objects: always a ClusterRole.
*/}}
{{- define "pgherd.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{- define "pgherd.rbacSubjects" -}}
- kind: ServiceAccount
  name: {{ include "pgherd.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
