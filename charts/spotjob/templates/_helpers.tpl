{{/*
Names and labels. The label app.kubernetes.io/name is always "spotjob" and the controller pods
always carry app.kubernetes.io/component: controller and app.kubernetes.io/instance: <release>:
the controller's per-job NetworkPolicies select its own pods by exactly these three.
*/}}

{{- define "spotjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "spotjob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := include "spotjob.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "spotjob.selectorLabels" -}}
app.kubernetes.io/name: spotjob
app.kubernetes.io/component: controller
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{- define "spotjob.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: spotjob
app.kubernetes.io/instance: {{ .Release.Name | quote }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: spotjob
{{- end }}

{{/*
Extra labels of an object (dict "root" $ "labels" VALUES): those the chart does not set itself on
it (spotjob.labels and the component), so no key is written twice in one mapping (YAML forbids it,
kustomize refuses the file, and other readers keep one or the other). The chart's own win, as over
podLabels.
*/}}
{{- define "spotjob.extraLabels" -}}
{{- $own := include "spotjob.labels" .root | fromYaml }}
{{- $_ := set $own "app.kubernetes.io/component" "controller" }}
{{- $extra := dict }}
{{- range $k, $v := .labels }}
{{- if not (hasKey $own $k) }}{{ $_ := set $extra $k $v }}{{ end }}
{{- end }}
{{- with $extra }}{{ toYaml . }}{{ end }}
{{- end }}

{{/*
An alert's labels (dict "severity" S "extra" metrics.prometheusRule.alertLabels): its severity,
unless alertLabels has one, which replaces it, and alertLabels; each key once.
*/}}
{{- define "spotjob.alertLabels" -}}
{{- toYaml (merge (dict) (.extra | default dict) (dict "severity" .severity)) }}
{{- end }}

{{/* The controller's pod labels as one flag value: k=v,k=v (--controller-pod-labels). */}}
{{- define "spotjob.selectorLabelsFlag" -}}
{{- $pairs := list }}
{{- range $k, $v := (include "spotjob.selectorLabels" . | fromYaml) }}
{{- $pairs = append $pairs (printf "%s=%s" $k $v) }}
{{- end }}
{{- join "," (sortAlpha $pairs) }}
{{- end }}

{{/* The metrics Service's name: a Service name is a DNS label (63 characters), so the full name
is cut to leave room for the suffix. */}}
{{- define "spotjob.metricsServiceName" -}}
{{- printf "%s-metrics" (include "spotjob.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "spotjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "spotjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "spotjob.leaseNamespace" -}}
{{- default .Release.Namespace .Values.leaderElection.leaseNamespace }}
{{- end }}

{{- define "spotjob.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
A duration of the schema's form (1m30s, 500ms: numbers with ms, s, m or h) in milliseconds.
*/}}
{{- define "spotjob.durationMs" -}}
{{- $ms := 0 }}
{{- range regexFindAll "[0-9]+(ms|s|m|h)" . -1 }}
{{- $n := regexFind "^[0-9]+" . | atoi }}
{{- $unit := trimPrefix (regexFind "^[0-9]+" .) . }}
{{- $ms = add $ms (mul $n (get (dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000) $unit)) }}
{{- end }}
{{- $ms }}
{{- end }}

{{/*
A resource quantity of the schema's form (a number, or digits with an optional fraction and suffix:
500m, 1.5Gi, 2) as a float, to compare a request with its limit.
*/}}
{{- define "spotjob.quantity" -}}
{{- if or (kindIs "float64" .) (kindIs "int64" .) (kindIs "int" .) }}
{{- float64 . }}
{{- else }}
{{- $num := regexFind "^[0-9]+([.][0-9]+)?" . }}
{{- $scale := dict "" 1.0 "m" 0.001 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- mulf (float64 $num) (get $scale (trimPrefix $num .)) }}
{{- end }}
{{- end }}

{{/*
Refuses a map's keys that are no Kubernetes label (or annotation) key (dict "value" NAME "map" MAP
"what" "label"): an optional DNS-subdomain prefix of at most 253 characters and '/', then a name of
at most 63 characters, letters and digits at both ends, '-', '_' and '.' between. The API server
refused them only when it met the object, after the rest of the release was created; the values
are checked by the schema, whose message for a key does not name the value it is in.
*/}}
{{- define "spotjob.validateKeys" -}}
{{- $value := .value }}
{{- $what := .what }}
{{- range $key, $_ := .map }}
{{- $parts := splitList "/" $key }}
{{- $name := last $parts }}
{{- $problem := "" }}
{{- if gt (len $parts) 2 }}
{{- $problem = "it has more than one '/'" }}
{{- else if and (eq (len $parts) 2) (or (gt (len (first $parts)) 253) (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" (first $parts)))) }}
{{- $problem = printf "its prefix %q is not a DNS subdomain (lower-case letters, digits, '-' and '.', at most 253 characters)" (first $parts) }}
{{- else if or (gt (len $name) 63) (not (regexMatch "^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$" $name)) }}
{{- $problem = printf "its name %q is not 1 to 63 letters, digits, '-', '_' and '.', starting and ending with a letter or digit" $name }}
{{- end }}
{{- with $problem }}
{{- fail (printf "%s: %q is no %s key the API server takes: %s. Use a key such as team or example.com/team." $value $key $what .) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Settings that no schema can check alone; failing here names the values to change.
*/}}
{{- define "spotjob.validate" -}}
{{- /* extraArgs come after the chart's own flags and the last one wins: one the chart sets from a
value would override it behind the rest of the chart's back (probes on the old port, two leaders).
argparse also takes an unambiguous prefix of a flag, hence the prefix test. */}}
{{- $modelled := dict "--http-port" "httpPort" "--agent-port" "agentPort" "--agent-launcher" "agentLauncher" "--log-level" "logLevel" "--log-format" "logFormat" "--agent-token-key-file" "agentTokenKey.existingSecret" "--leader-elect" "leaderElection.enabled" "--no-leader-elect" "leaderElection.enabled" "--lease-name" "leaderElection.leaseName" "--lease-namespace" "leaderElection.leaseNamespace" "--namespace" "watchNamespaces" "--network-policy" "networkPolicy.enabled" "--no-network-policy" "networkPolicy.enabled" "--controller-pod-labels" "networkPolicy.enabled" "--interruption-queue-url" "interruptionQueue.url" "--aws-region" "interruptionQueue.region" }}
{{- /* A flag wins over its variable, and the chart passes the flags; the rest come with RBAC the
chart grants from the value, or from the downward API. */}}
{{- $setEnv := dict "SPOTJOB_HTTP_PORT" "httpPort" "SPOTJOB_AGENT_PORT" "agentPort" "SPOTJOB_AGENT_LAUNCHER" "agentLauncher" "SPOTJOB_LOG_LEVEL" "logLevel" "SPOTJOB_LOG_FORMAT" "logFormat" "SPOTJOB_AGENT_TOKEN_KEY_FILE" "agentTokenKey.existingSecret" "SPOTJOB_LEADER_ELECT" "leaderElection.enabled" "SPOTJOB_LEASE_NAME" "leaderElection.leaseName" "SPOTJOB_NAMESPACES" "watchNamespaces" "SPOTJOB_NETWORK_POLICY" "networkPolicy.enabled" "SPOTJOB_CONTROLLER_POD_LABELS" "networkPolicy.enabled" "SPOTJOB_INTERRUPTION_QUEUE_URL" "interruptionQueue.url" "POD_NAME" "the downward API" "POD_NAMESPACE" "the downward API" }}
{{- range .Values.extraEnv }}
{{- if hasKey $setEnv (toString .name) }}
{{- fail (printf "extraEnv: %s is set by the chart from %s: set that instead" .name (get $setEnv (toString .name))) }}
{{- end }}
{{- /* The API server refuses a non-empty value beside a valueFrom (an empty one it takes), and a
valueFrom with no source or several, when it meets the Deployment, after the rest of the release
was created. */}}
{{- if and .value (hasKey . "valueFrom") }}
{{- fail (printf "extraEnv: %s has both value and valueFrom: the API server takes one or the other. Keep the one you mean." .name) }}
{{- end }}
{{- if and (hasKey . "valueFrom") (ne (len (keys (.valueFrom | default dict))) 1) }}
{{- fail (printf "extraEnv: %s has valueFrom with %d sources (%s): the API server takes exactly one of fieldRef, resourceFieldRef, configMapKeyRef and secretKeyRef." .name (len (keys (.valueFrom | default dict))) (keys (.valueFrom | default dict) | sortAlpha | join ", ")) }}
{{- end }}
{{- end }}
{{- /* Flags no value stands for that still break the release: the namespace the per-job
NetworkPolicies let in is the release's own (the downward API); --version and --help print and
exit 0, and the Deployment would restart the controller for ever. */}}
{{- $refused := dict "--controller-namespace" "the chart passes the release's namespace (POD_NAMESPACE, from the downward API), the one the per-job NetworkPolicies let the controller in from: install the release in the namespace the controller runs in instead" "--version" "the controller would print its version and exit, and the Deployment restart it for ever: run spotjob-controller --version outside the chart" "--help" "the controller would print its help and exit, and the Deployment restart it for ever: run spotjob-controller --help outside the chart" }}
{{- range $arg := .Values.extraArgs }}
{{- $flag := regexReplaceAll "=.*$" $arg "" }}
{{- range $name := keys $modelled | sortAlpha }}
{{- if and (gt (len $flag) 2) (hasPrefix $flag $name) }}
{{- fail (printf "extraArgs: %s repeats a flag the chart sets from %s (%s): set that value instead" $arg (get $modelled $name) $name) }}
{{- end }}
{{- end }}
{{- range $name := keys $refused | sortAlpha }}
{{- if and (gt (len $flag) 2) (hasPrefix $flag $name) }}
{{- fail (printf "extraArgs: %s (%s): %s" $arg $name (get $refused $name)) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* The API server refuses a container whose request is above its limit (the Deployment, after
the rest of the release was created): raising resources.requests.memory alone, over the default
limit, did that. */}}
{{- $resources := .Values.resources | default dict }}
{{- $requests := $resources.requests | default dict }}
{{- $limits := $resources.limits | default dict }}
{{- /* The controller's pods carry CPU and memory requests and a memory limit whatever the values
(README, "Locked-down namespaces"): admission policies that require them refuse the Deployment
otherwise, after the rest of the release was created. A null removes helm's default, and rendered
the container without it (limits: {} for resources.limits.memory: null), so it is refused here. */}}
{{- $missing := list }}
{{- if kindIs "invalid" (index $requests "cpu") }}{{ $missing = append $missing "resources.requests.cpu" }}{{ end }}
{{- if kindIs "invalid" (index $requests "memory") }}{{ $missing = append $missing "resources.requests.memory" }}{{ end }}
{{- if kindIs "invalid" (index $limits "memory") }}{{ $missing = append $missing "resources.limits.memory" }}{{ end }}
{{- with $missing }}
{{- fail (printf "%s: not set (null or left out), so the controller container would have no such request or limit, and admission policies that require CPU and memory requests and a memory limit would refuse the Deployment. Set each to a quantity (values.yaml: requests cpu 100m and memory 256Mi, limits memory 512Mi); no CPU limit is needed." (join ", " .)) }}
{{- end }}
{{- range $name, $limit := $limits }}
{{- if hasKey $requests $name }}
{{- $request := index $requests $name }}
{{- if gt (include "spotjob.quantity" $request | float64) (include "spotjob.quantity" $limit | float64) }}
{{- fail (printf "resources.requests.%s (%v) is more than resources.limits.%s (%v): the API server refuses such a container. Raise the limit with the request (or lower the request)." $name $request $name $limit) }}
{{- end }}
{{- end }}
{{- end }}
{{- /* The image reference is repository:tag or repository@digest: a tag or digest in the wrong
value made a reference the kubelet refuses (InvalidImageName), after `helm install` said deployed. */}}
{{- with .Values.image.repository }}
{{- if not (regexMatch "^([^/@\\s]+/)*[^/:@\\s]+$" .) }}
{{- fail (printf "image.repository %q carries a tag or a digest (the image would be %s): give the repository alone, and the tag in image.tag or the digest in image.digest." . (include "spotjob.image" $)) }}
{{- end }}
{{- /* Past the registry (a first part with '.' or ':', localhost, or a capital letter), every part
of the path is lower case: the kubelet refused Registry.io/MyOrg/controller's MyOrg the same way. */}}
{{- $parts := splitList "/" . }}
{{- $first := first $parts }}
{{- if and (gt (len $parts) 1) (or (regexMatch "[.:A-Z]" $first) (eq $first "localhost")) }}
{{- $parts = rest $parts }}
{{- end }}
{{- range $parts }}
{{- if not (regexMatch "^[a-z0-9]+(([.]|_|__|-+)[a-z0-9]+)*$" .) }}
{{- fail (printf "image.repository %q: its path part %q is not lower-case letters and digits joined by '.', '_', '__' or '-', so the kubelet would refuse the image (InvalidImageName). Use the repository as your registry lists it, in lower case (a registry host may keep its capitals)." $.Values.image.repository .) }}
{{- end }}
{{- end }}
{{- end }}
{{- with .Values.image.tag }}
{{- if not (regexMatch "^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}(@sha256:[a-f0-9]{64})?$" .) }}
{{- fail (printf "image.tag %q is not an image tag (letters, digits, '_', '.' and '-', at most 128, not starting with '.' or '-'): a digest (sha256:...) goes in image.digest." .) }}
{{- end }}
{{- end }}
{{- /* Tolerations the API server refuses in the Deployment, after the rest of the release was
created; the schema checks each field alone. */}}
{{- range $i, $t := .Values.tolerations }}
{{- $op := $t.operator | default "Equal" }}
{{- if and (not $t.key) (ne $op "Exists") }}
{{- fail (printf "tolerations[%d] has no key, so its operator must be Exists (it then tolerates every taint): set a key, or operator: Exists." $i) }}
{{- end }}
{{- if and (eq $op "Exists") $t.value }}
{{- fail (printf "tolerations[%d] has operator Exists and value %q: the API server refuses a value with Exists. Drop the value, or use operator: Equal." $i $t.value) }}
{{- end }}
{{- if and (hasKey $t "tolerationSeconds") (ne (toString $t.effect) "NoExecute") }}
{{- fail (printf "tolerations[%d] sets tolerationSeconds with effect %q: the API server takes tolerationSeconds only with effect NoExecute. Set effect: NoExecute, or drop tolerationSeconds." $i (toString ($t.effect | default ""))) }}
{{- end }}
{{- end }}
{{- range $i, $t := .Values.tolerations }}
{{- with $t.key }}
{{- include "spotjob.validateKeys" (dict "value" (printf "tolerations[%d].key" $i) "map" (dict . "") "what" "taint") }}
{{- end }}
{{- end }}
{{- /* Labels and annotations the chart writes on its objects, and the node labels the pods select. */}}
{{- include "spotjob.validateKeys" (dict "value" "podLabels" "map" .Values.podLabels "what" "label") }}
{{- include "spotjob.validateKeys" (dict "value" "nodeSelector" "map" .Values.nodeSelector "what" "label") }}
{{- include "spotjob.validateKeys" (dict "value" "podAnnotations" "map" .Values.podAnnotations "what" "annotation") }}
{{- /* Values a release made with an older chart may lack (helm upgrade --reuse-values keeps the old
values, without the new chart's defaults): read through empty dicts, never a nil map. */}}
{{- $metrics := .Values.metrics | default dict }}
{{- $rule := $metrics.prometheusRule | default dict }}
{{- include "spotjob.validateKeys" (dict "value" "serviceAccount.annotations" "map" (.Values.serviceAccount | default dict).annotations "what" "annotation") }}
{{- include "spotjob.validateKeys" (dict "value" "metrics.service.annotations" "map" ($metrics.service | default dict).annotations "what" "annotation") }}
{{- include "spotjob.validateKeys" (dict "value" "metrics.serviceMonitor.labels" "map" ($metrics.serviceMonitor | default dict).labels "what" "label") }}
{{- include "spotjob.validateKeys" (dict "value" "metrics.prometheusRule.labels" "map" $rule.labels "what" "label") }}
{{- include "spotjob.validateKeys" (dict "value" "metrics.prometheusRule.annotations" "map" $rule.annotations "what" "annotation") }}
{{- /* The node label a spread constraint counts domains by, and the pod labels it matches: label
keys the API server checks when it meets the Deployment. */}}
{{- range $i, $c := .Values.topologySpreadConstraints }}
{{- with $c.topologyKey }}
{{- include "spotjob.validateKeys" (dict "value" (printf "topologySpreadConstraints[%d].topologyKey" $i) "map" (dict . "") "what" "label") }}
{{- end }}
{{- range $j, $k := $c.matchLabelKeys }}
{{- include "spotjob.validateKeys" (dict "value" (printf "topologySpreadConstraints[%d].matchLabelKeys[%d]" $i $j) "map" (dict $k "") "what" "label") }}
{{- end }}
{{- end }}
{{- /* Alert labels are Prometheus label names, not Kubernetes keys: the Prometheus Operator (or
Prometheus loading the rules) refuses another name, after the release was created. */}}
{{- range $k, $_ := $rule.alertLabels }}
{{- if or (not (regexMatch "^[a-zA-Z_][a-zA-Z0-9_]*$" $k)) (hasPrefix "__" $k) }}
{{- fail (printf "metrics.prometheusRule.alertLabels: %q is no Prometheus label name: letters, digits and '_', not starting with a digit, and not starting with '__' (reserved). Use a name such as team or alert_team." $k) }}
{{- end }}
{{- end }}
{{- if and (gt (int .Values.replicas) 1) (not .Values.leaderElection.enabled) }}
{{- fail (printf "replicas is %d but leaderElection.enabled is false: two controllers without leader election would both act on every job. Set leaderElection.enabled=true or replicas=1." (int .Values.replicas)) }}
{{- end }}
{{- if and (not .Values.serviceAccount.create) (or .Values.serviceAccount.annotations .Values.serviceAccount.aws.roleArn .Values.serviceAccount.gcp.serviceAccount) }}
{{- fail "serviceAccount.create is false, so the chart annotates no ServiceAccount: serviceAccount.annotations, .aws.roleArn and .gcp.serviceAccount would be ignored, and the controller would run without its cloud identity. Annotate your ServiceAccount yourself and leave them empty, or set serviceAccount.create=true." }}
{{- end }}
{{- /* A Service's name is a DNS-1035 label: a release name helm takes (digits first, dots) can
make one the API server refuses, after the rest of the release was created. */}}
{{- if .Values.metrics.service.enabled }}
{{- $service := include "spotjob.metricsServiceName" . }}
{{- if not (regexMatch "^[a-z]([-a-z0-9]*[a-z0-9])?$" $service) }}
{{- fail (printf "the metrics Service would be named %q, which is no Service name (it must start with a letter, then lower-case letters, digits and '-'; it comes from the release name %q): set fullnameOverride (e.g. spotjob), or metrics.service.enabled=false." $service .Release.Name) }}
{{- end }}
{{- end }}
{{- if and .Values.interruptionQueue.region (not .Values.interruptionQueue.url) }}
{{- fail "interruptionQueue.region is set but interruptionQueue.url is empty: set the queue URL (terraform output interruption_queue_url) or drop the region." }}
{{- end }}
{{- /* The controller takes the queue's region from --aws-region, AWS_REGION / AWS_DEFAULT_REGION,
or the URL's host, and exits at start without one. The host's region as the controller reads it
(orchestrator/k8s/interruption_queue.py region_of): sqs.REGION.… (sqs-fips., a VPC endpoint's
….sqs.REGION.…), the legacy REGION.queue.amazonaws.com, and queue.amazonaws.com (us-east-1). */ -}}
{{- with .Values.interruptionQueue.url }}
{{- $host := regexReplaceAll "^[a-zA-Z]+://([^/?#]*@)?([^/:?#]*).*$" . "${2}" | lower }}
{{- $region := "[a-z]{2}(-[a-z]+)+-[0-9]+" }}
{{- $urlRegion := "" }}
{{- if regexMatch (printf "^(.*\\.)?(sqs|sqs-fips)\\.%s\\..+$" $region) $host }}
{{- $urlRegion = regexReplaceAll (printf "^(.*\\.)?(sqs|sqs-fips)\\.(%s)\\..+$" $region) $host "${3}" }}
{{- else if regexMatch "^queue\\.amazonaws\\.com(\\.cn)?$" $host }}
{{- $urlRegion = "us-east-1" }}
{{- else if regexMatch (printf "^%s\\.queue\\.amazonaws\\.com(\\.cn)?$" $region) $host }}
{{- $urlRegion = regexReplaceAll "^([a-z0-9-]+)\\.queue\\..*$" $host "${1}" }}
{{- end }}
{{- $inHost := ne $urlRegion "" }}
{{- $inEnv := false }}
{{- range $.Values.extraEnv }}
{{- if has .name (list "AWS_REGION" "AWS_DEFAULT_REGION") }}{{ $inEnv = true }}{{ end }}
{{- end }}
{{- /* SQS answers for a queue at its own region's endpoint only; the controller refuses a
--aws-region that contradicts the URL's at start (exit 2, a crash loop): say it here. */}}
{{- if and $inHost $.Values.interruptionQueue.region (ne $urlRegion $.Values.interruptionQueue.region) }}
{{- fail (printf "interruptionQueue.region %q is not the region of interruptionQueue.url %q (%s), and SQS answers for a queue only at its own region's endpoint: leave interruptionQueue.region empty (the URL's region is used) or fix the one that is wrong." $.Values.interruptionQueue.region . $urlRegion) }}
{{- end }}
{{- if not (or $inHost $.Values.interruptionQueue.region $inEnv) }}
{{- fail (printf "interruptionQueue.url %q names no AWS region (its host is neither sqs.REGION.amazonaws.com nor REGION.queue.amazonaws.com), so the controller would exit at start: set interruptionQueue.region (e.g. us-east-1)." .) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
RBAC rules from files/rbac.yaml, the one place they are written.
Arguments: dict "root" $ "scopes" (list of scopes to include).
Read rules first, then write rules; each preceded by its `why` as a comment.
*/}}
{{- define "spotjob.rbacRules" -}}
{{- $root := .root }}
{{- $scopes := .scopes }}
{{- $rules := (.root.Files.Get "files/rbac.yaml" | fromYaml).rules }}
{{- if not $rules }}{{ fail "files/rbac.yaml has no rules: the chart is broken" }}{{ end }}
{{- range $access := list "read" "write" }}
{{- range $rule := $rules }}
{{- if and (eq $rule.access $access) (has $rule.scope $scopes) }}
{{- $granted := true }}
{{- if $rule.when }}
{{- $value := $root.Values }}
{{- range $key := splitList "." $rule.when }}
{{- $value = index $value $key }}
{{- end }}
{{- $granted = not (empty $value) }}
{{- end }}
{{- if $granted }}
# {{ $access | title }}: {{ $rule.why | wrapWith 96 "\n# " }}
- apiGroups: {{ toJson $rule.apiGroups }}
  resources: {{ toJson $rule.resources }}
  {{- with $rule.resourceNames }}
  {{- $names := list }}
  {{- range . }}
  {{- $names = append $names (eq . "$leaseName" | ternary $root.Values.leaderElection.leaseName .) }}
  {{- end }}
  resourceNames: {{ toJson $names }}
  {{- end }}
  verbs: {{ toJson $rule.verbs }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
