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

{{- /*
The name of one of the release's dashboard ConfigMaps, given its file's name without ".json"
(call with a list: `include "holeblend.dashboardName" (list . "holeblend-blenddeployment")`):
"<release>-operator-<release namespace>-<dashboard>". The ConfigMap's one key is this name with
".json": Grafana's sidecar writes every key of every ConfigMap it finds into one folder, and
per-team installs share a release name and often the namespace the sidecar watches. Named by
the release alone, the second install's ConfigMap would be the first one's (helm refuses it),
and its file would overwrite the first one's. At most 63 characters like the release's other
names: a longer one is cut to 54 and ends with 8 hex digits of a hash of the whole.
*/ -}}
{{- define "holeblend.dashboardName" -}}
{{- $name := printf "%s-%s" (include "holeblend.clusterName" (index . 0)) (index . 1) -}}
{{- if le (len $name) 63 -}}
{{- $name -}}
{{- else -}}
{{- printf "%s-%s" ($name | trunc 54 | trimSuffix "-") ($name | sha256sum | trunc 8) -}}
{{- end -}}
{{- end -}}

{{- /*
The Grafana uid of one of the release's dashboards (called like holeblend.dashboardName):
"<dashboard>-<8 hex digits of a hash of release namespace, release and dashboard>", the
dashboard's part cut to 31 characters so the whole stays within Grafana's 40. Grafana keeps
one dashboard per uid: with the file's own uid, two installs' dashboards would replace each
other at every sidecar reload.
*/ -}}
{{- define "holeblend.dashboardUid" -}}
{{- $ctx := index . 0 -}}
{{- $dashboard := index . 1 -}}
{{- $hash := printf "%s/%s/%s" $ctx.Release.Namespace $ctx.Release.Name $dashboard | sha256sum | trunc 8 -}}
{{- printf "%s-%s" ($dashboard | trunc 31 | trimSuffix "-") $hash -}}
{{- end -}}

{{- /*
The alert rules (rules/holeblend.rules.yaml) with every selector of every expression limited to
watchNamespaces: `namespace=~"<a>|<b>"`, the namespace of the BlendDeployment both the engine's
and the operator's tuning series carry. Per-team installs each watch their team's namespaces;
unscoped, each install's rules would fire for every team's BlendDeployments. Call only with
watchNamespaces set: an install that watches every namespace loads the file as it is.
*/ -}}
{{- define "holeblend.scopedRules" -}}
{{- $rules := .Files.Get "rules/holeblend.rules.yaml" | fromYaml -}}
{{- $matcher := printf "namespace=~%q" (join "|" .Values.watchNamespaces) -}}
{{- range $rules.groups -}}
{{- range .rules -}}
{{- $expr := regexReplaceAll `\b(holeblend_[a-z0-9_]+|up)\{` .expr (printf "${1}{%s, " $matcher) -}}
{{- $_ := set . "expr" (regexReplaceAll `\b(holeblend_[a-z0-9_]+)([^a-z0-9_{]|$)` $expr (printf "${1}{%s}${2}" $matcher)) -}}
{{- end -}}
{{- end -}}
{{- toYaml $rules -}}
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
