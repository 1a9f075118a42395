{{- /*
The name of one of this release's objects: "<release>-operator", or "<release>-operator-<suffix>"
given a suffix (call with a list: `include "holeblend.name" (list . "metrics")`).

Every name is cut to 63 characters, the strictest limit of the kinds the chart renders: a
Service's name is a DNS-1035 label, and the Deployment's name ends up in its pods' names and
hostnames. The release name's part is what gets cut, so the suffix survives and two names of
one release never collide; a name never ends with "-". Dots (allowed in release names) become
"-", and a name starting with a digit gets an "hb-" prefix: a DNS-1035 label starts with a
letter.
*/ -}}
{{- define "holeblend.name" -}}
{{- $ctx := index . 0 -}}
{{- $suffix := index . 1 -}}
{{- $base := printf "%s-operator" ($ctx.Release.Name | replace "." "-") -}}
{{- if not (regexMatch "^[a-z]" $base) -}}
{{- $base = printf "hb-%s" $base -}}
{{- end -}}
{{- if $suffix -}}
{{- printf "%s-%s" ($base | trunc (int (sub 62 (len $suffix))) | trimSuffix "-") $suffix -}}
{{- else -}}
{{- $base | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- /* The operator's name: its Deployment, ServiceAccount, Roles and RoleBindings. */ -}}
{{- define "holeblend.fullname" -}}
{{- include "holeblend.name" (list . "") -}}
{{- end -}}

{{- /*
The name of the release's cluster-scoped objects (ClusterRole, ClusterRoleBinding,
ClusterKopfPeering) and so of its kopf peering: "<release>-operator-<release namespace>".
Per-team installs share a release name in different namespaces; named by the release alone,
the second install would find the first one's objects (helm refuses to adopt them). At most
127 characters (the operator's 63, "-" and a namespace's 63), within the 253 of RBAC names
and of a DNS subdomain.
*/ -}}
{{- define "holeblend.clusterName" -}}
{{- printf "%s-%s" (include "holeblend.fullname" .) .Release.Namespace -}}
{{- end -}}

{{- define "holeblend.labels" -}}
app.kubernetes.io/name: holeblend
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: operator
app.kubernetes.io/managed-by: {{ .Release.Service | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | replace "+" "_" | trunc 63 | trimSuffix "-" | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" | quote }}
{{- end -}}

{{- define "holeblend.selectorLabels" -}}
app.kubernetes.io/name: holeblend
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "holeblend.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "holeblend.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- /* An image reference: repository@digest when a digest is set, else repository:tag. */ -}}
{{- define "holeblend.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}
{{- end -}}
