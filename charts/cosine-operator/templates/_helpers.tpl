{{/* Chart name, truncated to 63 characters (DNS label). */}}
{{- define "cosine-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: fullnameOverride, else release-name unless the release name already
contains the name. */}}
{{- define "cosine-operator.fullname" -}}
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

{{- define "cosine-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "cosine-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "cosine-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The pod's selector labels as k=v,k=v (COSINE_OPERATOR_POD_LABELS). */}}
{{- define "cosine-operator.podLabelsList" -}}
{{- $pairs := list }}
{{- range $k, $v := include "cosine-operator.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{- define "cosine-operator.labels" -}}
helm.sh/chart: {{ include "cosine-operator.chart" . }}
{{ include "cosine-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: operator
{{- end }}

{{/* Labels of the chart's hook objects and their pods (the sample's Jobs, the `helm test` pod;
dict "root" $ "component" NAME): the release's, without the operator's selector label
(app.kubernetes.io/name), so the operator's Service never routes the webhook to such a pod. */}}
{{- define "cosine-operator.hookLabels" -}}
helm.sh/chart: {{ include "cosine-operator.chart" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "cosine-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "cosine-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name: the existing ServiceAccount to run as (serviceAccount.create is false)" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Cluster-scoped objects' name (ClusterRole, ClusterRoleBinding, webhook configuration): the
release's namespace and fullname, so a release of the same name in another namespace is another object. */}}
{{- define "cosine-operator.clusterName" -}}
{{- list .Release.Namespace (include "cosine-operator.fullname" .) | compact | join "-" }}
{{- end }}

{{/* The chart's pods' securityContexts (values.podSecurityContext, values.securityContext). */}}
{{- define "cosine-operator.podSecurityContext" -}}
{{- with .Values.podSecurityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "cosine-operator.securityContext" -}}
{{- with .Values.securityContext -}}
securityContext:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "cosine-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The webhook's TLS secret and the Service name the API server calls. */}}
{{- define "cosine-operator.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "cosine-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* RBAC rules: exactly what cosine_operator.kube.CALLS and kopf itself use (tests/operator/test_chart.py). */}}
{{- define "cosine-operator.namespacedRules" -}}
- apiGroups: ["cosine.dev"]
  resources: ["cosineclusters"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["cosine.dev"]
  resources: ["cosineclusters/status"]
  verbs: ["patch"]
- apiGroups: ["cosine.dev"]
  resources: ["cosinedrafterpools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["cosine.dev"]
  resources: ["cosinedrafterpools/status"]
  verbs: ["patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps", "persistentvolumeclaims"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["batch"]
  resources: ["jobs"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["inference.networking.k8s.io"]
  resources: ["inferencepools"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["gateway.networking.k8s.io"]
  resources: ["httproutes"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["leaderworkerset.x-k8s.io"]
  resources: ["leaderworkersets"]
  verbs: ["get", "list", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["networking.gke.io"]
  resources: ["gcpbackendpolicies", "healthcheckpolicies"]
  verbs: ["list", "create", "patch", "delete"]
- apiGroups: ["networking.istio.io"]
  resources: ["destinationrules"]
  verbs: ["list", "create", "patch", "delete"]
# held to grant them: the endpoint picker's Role (kube.GRANTS), as llm-d's charts write it
- apiGroups: ["inference.networking.x-k8s.io", "llm-d.ai"]
  resources: ["inferenceobjectives", "inferencemodelrewrites"]
  verbs: ["get", "list", "watch"]
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch", "create", "update", "patch", "delete"]
{{- if and .Values.peering.enabled .Values.watchNamespaces }}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}
{{- end }}

{{/* The webhook's CA and serving certificate ({ca, crt, key}, base64): from values
(webhook.certificate) if set; else self-signed and kept across upgrades: the existing Secret's if
there is one (`lookup`; empty under `helm template`), else new. Computed once per render (kept in
.Values) so the Secret, the caBundle and the operator's restart checksum agree. */}}
{{- define "cosine-operator.webhookCert" -}}
{{- if not (hasKey .Values "__webhookCert") }}
{{- $fullname := include "cosine-operator.fullname" . }}
{{- $service := printf "%s.%s.svc" $fullname .Release.Namespace }}
{{- $given := .Values.webhook.certificate }}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "cosine-operator.webhookSecret" .) }}
{{- $data := (($existing | default dict).data | default dict) }}
{{- $cert := dict }}
{{- if or $given.crt $given.key $given.ca }}
{{- if not (and $given.crt $given.key $given.ca) }}
{{- fail "webhook.certificate: set crt, key and ca (PEM), or none" }}
{{- end }}
{{- $cert = dict "ca" ($given.ca | b64enc) "crt" ($given.crt | b64enc) "key" ($given.key | b64enc) }}
{{- else if and (index $data "ca.crt") (index $data "tls.crt") (index $data "tls.key") }}
{{- $cert = dict "ca" (index $data "ca.crt") "crt" (index $data "tls.crt") "key" (index $data "tls.key") }}
{{- else }}
{{- $ca := genCA (printf "%s-ca" $fullname) 3650 }}
{{- $signed := genSignedCert $service nil (list $service (printf "%s.%s" $fullname .Release.Namespace) $fullname) 3650 $ca }}
{{- $cert = dict "ca" ($ca.Cert | b64enc) "crt" ($signed.Cert | b64enc) "key" ($signed.Key | b64enc) }}
{{- end }}
{{- $_ := set .Values "__webhookCert" $cert }}
{{- end }}
{{- toYaml (get .Values "__webhookCert") }}
{{- end }}

{{/*
The components of a CoSineCluster whose pods the workloads' monitor scrapes: the verifier, the
drafters, and spec.router's endpoint picker (operator builders' labels: app.kubernetes.io/component).
*/}}
{{- define "cosine-operator.scrapedComponents" -}}
[verifier, drafter, router]
{{- end }}

{{/*
The scrape jobs CoSine's rules watch: what the chart's monitors name their targets' `job` (a
ServiceMonitor's: its Service's name; a PodMonitor's: <namespace>/<name>; GMP's PodMonitoring and
ClusterPodMonitoring: their name), unless metrics.prometheusRule names your own scrape's.
*/}}
{{- define "cosine-operator.operatorJob" -}}
{{- .Values.metrics.prometheusRule.operatorJob | default (include "cosine-operator.fullname" .) }}
{{- end }}

{{- define "cosine-operator.workloadsJob" -}}
{{- $name := printf "%s-workloads" (include "cosine-operator.fullname" .) }}
{{- if eq .Values.metrics.provider "gmp" }}
{{- .Values.metrics.prometheusRule.workloadsJob | default $name }}
{{- else }}
{{- .Values.metrics.prometheusRule.workloadsJob | default (printf "%s/%s" .Release.Namespace $name) }}
{{- end }}
{{- end }}

{{/*
CoSine's rule groups (files/rules/), as many as what is scraped can feed: the runtime's with the
workloads' monitor (metrics.podMonitor, or your own scrape named in prometheusRule.workloadsJob),
the operator's with its monitor (metrics.serviceMonitor, or prometheusRule.operatorJob), and
CoSineVerifierDown, which reads both, with both. A rule on a series nobody scrapes either never
fires or, read as absence, fires for ever (CoSineOperatorDown without the operator's monitor).
*/}}
{{- define "cosine-operator.ruleGroups" -}}
{{- $rule := .Values.metrics.prometheusRule }}
{{- $operator := or .Values.metrics.serviceMonitor.enabled $rule.operatorJob }}
{{- $workloads := or .Values.metrics.podMonitor.enabled $rule.workloadsJob }}
{{- if not (or $operator $workloads) }}
{{- fail "metrics.prometheusRule needs a scrape to alert on: metrics.serviceMonitor (the operator), metrics.podMonitor (the clusters' pods), or the jobs of your own scrape configs (metrics.prometheusRule.operatorJob, workloadsJob)" }}
{{- end }}
{{- $files := list }}
{{- if $workloads }}{{ $files = append $files "files/rules/runtime.yaml" }}{{ end }}
{{- if $operator }}{{ $files = append $files "files/rules/operator.yaml" }}{{ end }}
{{- if and $operator $workloads }}{{ $files = append $files "files/rules/clusters.yaml" }}{{ end }}
{{- $runbook := $rule.runbookUrl | default (printf "https://github.com/cosine-project/cosine/blob/v%s/docs/runbooks.md" .Chart.AppVersion) }}
{{- $budget := subf 1.0 $rule.tpotSlo.objective }}
{{- range $files }}
{{ $.Files.Get .
    | replace "__RUNBOOK_URL__" $runbook
    | replace "__TPOT_SLO_SECONDS__" (toString $rule.tpotSlo.seconds)
    | replace "__FAST_BURN__" (printf "%.4g" (mulf 14.4 $budget))
    | replace "__SLOW_BURN__" (printf "%.4g" (mulf 6.0 $budget))
    | replace "__OPERATOR_JOB__" (include "cosine-operator.operatorJob" $)
    | replace "__OPERATOR_NAMESPACE__" $.Release.Namespace
    | replace "__WORKLOADS_JOB__" (include "cosine-operator.workloadsJob" $) }}
{{- end }}
{{- end }}
