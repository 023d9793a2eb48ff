{{- /*
gpufence.certsPodTemplate: the pod of the certificate Job and CronJob, which runs
`gpufence-certs bootstrap`: it creates (or renews) the CA and serving certificate in Secret
gpufence-webhook-tls (tls.crt, tls.key, ca.crt) and writes the CA into the caBundle of the
`gpufence` MutatingWebhookConfiguration and of the `gpufence` ValidatingWebhookConfiguration.
Idempotent; the Job retries (backoffLimit) while the MutatingWebhookConfiguration does not exist
yet; a missing ValidatingWebhookConfiguration is only logged, and the next run sets it.
*/ -}}
{{- define "gpufence.certsPodTemplate" -}}
metadata:
  labels:
    app.kubernetes.io/name: gpufence-certs
    app.kubernetes.io/component: certs
spec:
  restartPolicy: OnFailure
  serviceAccountName: gpufence-certs
  automountServiceAccountToken: true
  enableServiceLinks: false
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    seccompProfile:
      type: RuntimeDefault
  containers:
    - name: certs
      image: {{ include "gpufence.image" . }}
      imagePullPolicy: {{ include "gpufence.imagePullPolicy" . }}
      command: ["gpufence-certs"]
      args:
        - bootstrap
        - --namespace=gpufence
        - --secret=gpufence-webhook-tls
        - --service=gpufence-webhook
        - --webhook-configuration=gpufence
      resources:
        requests:
          cpu: 10m
          memory: 64Mi
        limits:
          memory: 128Mi
      securityContext:
        runAsNonRoot: true
        allowPrivilegeEscalation: false
        readOnlyRootFilesystem: true
        capabilities:
          drop: ["ALL"]
        seccompProfile:
          type: RuntimeDefault
      volumeMounts:
        - name: tmp
          mountPath: /tmp
  volumes:
    - name: tmp
      emptyDir:
        medium: Memory
        sizeLimit: 16Mi
{{- end -}}
