{{/* Full name of the release's objects, at most 63 characters. */}}
{{- define "adaflash.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "adaflash.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}-operator
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "adaflash.labels" -}}
{{ include "adaflash.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: adaflash
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "adaflash.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "adaflash.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "adaflash.image" -}}
{{- printf "%s:%s" .Values.operator.image.repository (default .Chart.AppVersion .Values.operator.image.tag) -}}
{{- end -}}

{{/* The operator's permissions; bound cluster-wide or per watched namespace. RBAC cannot say
"only what the operator made": the operatorGuard admission policy (operatorguard.yaml) does. */}}
{{- define "adaflash.rules" -}}
# Its own resources: watch AdaFlashServices, record DrafterVersions.
- apiGroups: ["adaflash.io"]
  resources: ["adaflashservices"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["adaflash.io"]
  resources: ["adaflashservices/status", "drafterversions/status"]
  verbs: ["get", "patch"]
# Children carry blockOwnerDeletion: where OwnerReferencesPermissionEnforcement is on
# (OpenShift), setting it needs update on the owner's finalizers.
- apiGroups: ["adaflash.io"]
  resources: ["adaflashservices/finalizers"]
  verbs: ["update"]
- apiGroups: ["adaflash.io"]
  resources: ["drafterversions"]
  verbs: ["get", "list", "create", "patch"]
# Children it creates, adopts and updates by server-side apply (never deletes: owner
# references do).
- apiGroups: [""]
  resources: ["configmaps", "services", "serviceaccounts", "persistentvolumeclaims"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["apps"]
  resources: ["deployments"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["batch"]
  resources: ["jobs", "cronjobs"]
  verbs: ["get", "create", "patch"]
# Multi-node distillation rounds (spec.distillation.nodes > 1) where the cluster serves JobSet
# (detected through discovery; without it: an Indexed Job and a headless Service).
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create", "patch"]
# Optional children, deleted when the spec turns them off (an HPA left behind would go on
# scaling): the only deletes the operator makes, of objects it controls.
- apiGroups: ["policy"]
  resources: ["poddisruptionbudgets"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
- apiGroups: ["autoscaling"]
  resources: ["horizontalpodautoscalers"]
  verbs: ["get", "create", "patch", "delete"]
# KEDA, where installed (found through discovery, never assumed).
- apiGroups: ["keda.sh"]
  resources: ["scaledobjects"]
  verbs: ["get", "create", "patch", "delete"]
# The per-service admin token of the serving pods: created once, never read (no get, list or
# watch: the operator can read no Secret, and never calls the admin endpoint).
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["create"]
# Serving pods: read what they report, annotate canaries. The serving pods' own Role grants
# get/patch on pods, which the operator must hold itself to grant it.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "patch"]
# A distillation report cut at the termination message's 4096 bytes is read from the log.
- apiGroups: [""]
  resources: ["pods/log"]
  verbs: ["get"]
- apiGroups: ["", "events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end -}}
