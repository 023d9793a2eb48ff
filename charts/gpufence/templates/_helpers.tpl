{{- /*
Names, labels and the values that need more than a lookup. Every object goes to the namespace
`gpufence`, written out in each template: the webhook configurations' and the protect policy's namespace
exclusions, the webhook's Service reference, the certificate's DNS names and the certificate Job's
arguments all name it, as in the kustomize install (k8s/base/kustomization.yaml).
*/ -}}

{{- /*
gpufence.labels: the labels of an object. Call with
  (dict "context" $ "name" "gpufence-webhook" "component" "webhook")
and, for the monitoring objects, "extra" .Values.monitoring.labels. name and component say which
object it is (as in k8s/); part-of and version are what k8s/base/kustomization.yaml adds to every
object; then Helm's own three (helm.sh/chart, app.kubernetes.io/managed-by,
app.kubernetes.io/instance), which the drift test (tests/deploy/test_chart_drift.py) ignores.
*/ -}}
{{- define "gpufence.labels" -}}
{{- $own := dict "app.kubernetes.io/part-of" "gpufence" "app.kubernetes.io/version" .context.Chart.AppVersion -}}
{{- if .name }}{{ $_ := set $own "app.kubernetes.io/name" .name }}{{ end -}}
{{- if .component }}{{ $_ := set $own "app.kubernetes.io/component" .component }}{{ end -}}
{{- $helm := dict
    "helm.sh/chart" (printf "%s-%s" .context.Chart.Name .context.Chart.Version | replace "+" "_")
    "app.kubernetes.io/managed-by" .context.Release.Service
    "app.kubernetes.io/instance" .context.Release.Name -}}
{{- toYaml (merge $helm (.extra | default dict) $own) -}}
{{- end -}}

{{- /* gpufence.image: the one image of the webhook, the certificate Job/CronJob and the sidecar. */ -}}
{{- define "gpufence.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (.Values.image.tag | default .Chart.AppVersion)) -}}
{{- end -}}

{{- define "gpufence.imagePullPolicy" -}}
{{- .Values.image.pullPolicy | default "IfNotPresent" -}}
{{- end -}}

{{- /*
gpufence.policyKeys: the flags of gpufence-webhook that configure the injection, without "--"
(gpufence/webhook/flags.py, the flags that settings_from_args reads): the keys the ConfigMap
gpufence-policy may hold. tests/deploy/test_helm.py checks this list against the webhook's own.
*/ -}}
{{- define "gpufence.policyKeys" -}}
sidecar-image sidecar-image-pull-policy gpu-resource-name exclusive-gpu-resource-name
non-gpu-resource-claims kai-scheduler-name dra-gpu-driver-name sidecar-mode sidecar-metrics-port
sidecar-cpu-request sidecar-cpu-limit sidecar-memory-request sidecar-memory-limit
default-memory default-compute max-memory max-compute default-mode allow-audit allow-opt-out
default-grace-period sidecar-poll-interval sidecar-nvidia-visible-devices
sidecar-nvidia-driver-capabilities sidecar-mount-host-proc sidecar-host-proc-mount-path
void-non-gpu-containers driver-memory-limits mps-limits preload-library preload-library-mount-dir gpu-memory
pytorch-memory-fraction framework-memory-headroom admin-groups device-access-namespaces
other-namespace-gpu-processes host-gpu-processes
{{- end -}}

{{- /* The policy flags that repeat; their ConfigMap value is the list, comma-separated. */ -}}
{{- define "gpufence.repeatedPolicyKeys" -}}
gpu-resource-name exclusive-gpu-resource-name non-gpu-resource-claims dra-gpu-driver-name gpu-memory admin-groups kai-scheduler-name device-access-namespaces
{{- end -}}

{{- /* The webhook's other flags, which webhook.flags may set (the chart sets port, the TLS files
and --policy-configmap itself). */ -}}
{{- define "gpufence.serverFlags" -}}
bind-address cert-reload-interval kubeconfig log-level shutdown-delay event-loop
{{- end -}}

{{- /*
gpufence.flagValue: a value as the webhook reads it: booleans "true"/"false", a list
comma-separated, a whole number without exponent (Helm reads numbers from values files as floats,
which would print 536870912 as 5.36870912e+08), anything else as written.
*/ -}}
{{- define "gpufence.flagValue" -}}
{{- if kindIs "slice" . -}}
  {{- $items := list -}}
  {{- range . }}{{ $items = append $items (include "gpufence.flagValue" .) }}{{ end -}}
  {{- join "," $items -}}
{{- else if kindIs "bool" . -}}
  {{- ternary "true" "false" . -}}
{{- else if and (kindIs "float64" .) (eq . (floor .)) -}}
  {{- int64 . -}}
{{- else -}}
  {{- toString . -}}
{{- end -}}
{{- end -}}

{{- /*
gpufence.policyData: the data of ConfigMap gpufence-policy, as YAML: policy.* (a null value
drops its key), sidecar-image from image.*, sidecar-image-pull-policy from image.pullPolicy where
policy does not set it. Fails, naming the value, on a key the webhook does not read.
*/ -}}
{{- define "gpufence.policyData" -}}
{{- $keys := regexSplit "\\s+" (include "gpufence.policyKeys" $) -1 -}}
{{- $repeated := include "gpufence.repeatedPolicyKeys" $ | splitList " " -}}
{{- if hasKey $.Values "gpuResourceNames" -}}
  {{- fail (printf "gpuResourceNames: %v: this value moved into the policy ConfigMap; set policy.gpu-resource-name instead, e.g. policy.gpu-resource-name: [nvidia.com/gpu, nvidia.com/mig-1g.10gb]" $.Values.gpuResourceNames) -}}
{{- end -}}
{{- $data := dict -}}
{{- range $key, $value := $.Values.policy -}}
  {{- if not (has $key $keys) -}}
    {{- fail (printf "policy.%s: %v: not a policy setting of gpufence-webhook; the keys are its injection flags without \"--\" (%s), e.g. policy.max-memory: \"16Gi\"" $key $value (without $keys "sidecar-image" | join ", ")) -}}
  {{- end -}}
  {{- if eq $key "sidecar-image" -}}
    {{- fail (printf "policy.sidecar-image: %v: the sidecar runs the chart's image; set image.repository and image.tag instead, e.g. --set image.tag=%s" $value $.Chart.AppVersion) -}}
  {{- end -}}
  {{- if and (kindIs "slice" $value) (not (has $key $repeated)) -}}
    {{- fail (printf "policy.%s: %v: a list, but only %s take several values; give one, e.g. policy.%s: %v" $key $value (join ", " $repeated) $key (first $value)) -}}
  {{- end -}}
  {{- if not (kindIs "invalid" $value) }}{{ $_ := set $data $key (include "gpufence.flagValue" $value) }}{{ end -}}
{{- end -}}
{{- $_ := set $data "sidecar-image" (include "gpufence.image" $) -}}
{{- if and $.Values.image.pullPolicy (not (hasKey $data "sidecar-image-pull-policy")) -}}
  {{- $_ := set $data "sidecar-image-pull-policy" $.Values.image.pullPolicy -}}
{{- end -}}
{{- toYaml $data -}}
{{- end -}}

{{- /*
gpufence.webhookFlags: webhook.flags as arguments, one "- --flag=value" line each (a list repeats
the flag), in name order. Fails on a policy flag (those live in the ConfigMap gpufence-policy) and
on a flag the chart sets itself.
*/ -}}
{{- define "gpufence.webhookFlags" -}}
{{- $policy := regexSplit "\\s+" (include "gpufence.policyKeys" $) -1 -}}
{{- $server := include "gpufence.serverFlags" $ | splitList " " -}}
{{- $flags := $.Values.webhook.flags | default dict -}}
{{- range $flag := keys $flags | sortAlpha -}}
  {{- $value := get $flags $flag -}}
  {{- if has $flag $policy -}}
    {{- fail (printf "webhook.flags.%s: %v: a policy setting, which the webhook reads from the ConfigMap gpufence-policy; set policy.%s instead, e.g. policy.%s: %s" $flag $value $flag $flag (toJson $value)) -}}
  {{- else if eq $flag "port" -}}
    {{- fail (printf "webhook.flags.port: %v: the chart sets --port from webhook.port (the container port follows it); set webhook.port instead, e.g. webhook.port: 9443" $value) -}}
  {{- else if not (has $flag $server) -}}
    {{- fail (printf "webhook.flags.%s: %v: not a flag webhook.flags can set; those are %s (the chart sets --port, --tls-cert-file, --tls-private-key-file and --policy-configmap), e.g. webhook.flags.log-level: debug" $flag $value (join ", " $server)) -}}
  {{- end -}}
  {{- range $v := ternary $value (list $value) (kindIs "slice" $value) }}
- {{ printf "--%s=%s" $flag (include "gpufence.flagValue" $v) | toJson }}
  {{- end -}}
{{- end -}}
{{- end -}}
