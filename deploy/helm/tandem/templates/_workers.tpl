{{/* A worker group: Deployment, headless Service (its SRV records are how the router finds the
pods), PodDisruptionBudget. (dict "ctx" $ "role" "decode" "g" .Values.decode) */}}
{{- define "tandem.workers" -}}
{{- $ := .ctx }}
{{- $g := .g }}
{{- $role := .role }}
{{- $full := include "tandem.fullname" $ }}
{{- $sel := include "tandem.selector" (dict "ctx" $ "role" $role) }}
{{- if and (gt (int $g.tensorParallel) 1) (hasPrefix "cuda" $g.device) }}
{{- fail (printf "%s.tensorParallel %v on device %s: tensor parallelism runs on device cpu in this release (the GPU backend takes one GPU per worker)" $role $g.tensorParallel $g.device) }}
{{- end }}
{{- $ep := int (default 1 $g.expertParallel) }}
{{- $disk := default (dict "enabled" false) $g.kvDisk }}
{{- if and $disk.enabled $disk.shared (not $disk.claimName) }}
{{- fail (printf "%s.kvDisk.shared needs a claimName: a ReadWriteMany PersistentVolumeClaim the group shares (an emptyDir is each pod's own)" $role) }}
{{- end }}
{{- if and (gt $ep 1) (hasPrefix "cuda" $g.device) }}
{{- fail (printf "%s.expertParallel %v on device %s: expert parallelism runs on device cpu in this release" $role $ep $g.device) }}
{{- end }}
{{- if and (gt $ep 1) (gt (int $g.tensorParallel) 1) }}
{{- fail (printf "%s.expertParallel %v with tensorParallel %v: a worker's ranks are tensor-parallel or expert-parallel, not both" $role $ep $g.tensorParallel) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $full }}-{{ $role }}
  labels:
    {{- include "tandem.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  {{- if not $.Values.autoscaling.enabled }}
  replicas: {{ $g.replicas }}
  {{- end }}
  selector:
    matchLabels:
      {{- $sel | nindent 6 }}
  template:
    metadata:
      labels:
        {{- $sel | nindent 8 }}
    spec:
      {{- with $.Values.image.pullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        runAsNonRoot: true
        runAsUser: 10001
        fsGroup: 10001
      # preStop, then SIGTERM: the worker reports draining and NOT_SERVING first; a decode worker
      # hands its running requests over and serves the pulls of their KV (up to the hand-off
      # window), then deregisters (etcd) and lets what is left finish for up to the drain
      # timeout; Kubernetes waits longer than both.
      terminationGracePeriodSeconds: {{ add $g.drainTimeoutSeconds (default 0 $g.handoffWindowSeconds) 15 }}
      containers:
        - name: {{ $role }}
          image: {{ include "tandem.image" $ }}
          imagePullPolicy: {{ $.Values.image.pullPolicy }}
          args:
            - {{ $role }}
            - --host=0.0.0.0
            - --port={{ $g.port }}
            - --advertise-host=$(POD_IP)
            - --worker-id=$(POD_NAME)
            - --device={{ $g.device }}
            - --kv-link={{ $g.kvLink }}
            - --kv-cache-mb={{ $g.kvCacheMb }}
            - --drain-timeout-s={{ $g.drainTimeoutSeconds }}
            {{- if gt (int $g.threads) 0 }}
            - --threads={{ $g.threads }}
            {{- end }}
            {{- if gt (int $g.tensorParallel) 1 }}
            - --tp={{ $g.tensorParallel }}
            {{- end }}
            {{- if gt $ep 1 }}
            - --ep={{ $ep }}
            {{- end }}
            {{- if $disk.enabled }}
            - --kv-disk-dir=/kv-disk
            - --kv-disk-gb={{ $disk.sizeGb }}
            {{- if $disk.shared }}
            - --kv-disk-shared
            {{- end }}
            {{- end }}
            {{- if eq $role "decode" }}
            - --kv-port={{ $g.kvPort }}
            - --kv-advertise-host=$(POD_IP)
            - --kv-stall-timeout-ms={{ int64 $g.kvStallTimeoutMs }}
            - --kv-deadline-slack={{ $g.kvDeadlineSlack }}
            - --handoff-window-s={{ $g.handoffWindowSeconds }}
            {{- end }}
            {{- if eq $.Values.discovery.mode "etcd" }}
            - --discovery=etcd://{{ join "," $.Values.discovery.etcd.endpoints }}
            - --cluster={{ $.Values.discovery.etcd.cluster }}
            - --lease-ttl-s={{ $.Values.discovery.etcd.leaseTtlSeconds }}
            {{- else }}
            - --discovery=k8s
            {{- end }}
            {{- range $g.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef: {fieldPath: status.podIP}
            - name: POD_NAME
              valueFrom:
                fieldRef: {fieldPath: metadata.name}
            - name: TANDEM_KV_SECRET
              valueFrom:
                secretKeyRef:
                  name: {{ include "tandem.kvSecretName" $ }}
                  key: kv-secret
            {{- include "tandem.commonEnv" (dict "ctx" $) | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ $g.port }}
            {{- if eq $role "decode" }}
            - name: kv
              containerPort: {{ $g.kvPort }}
            {{- end }}
          # Before SIGTERM: the worker leaves the cluster (NOT_SERVING, its etcd card deleted,
          # new requests refused) and finishes what it runs; SIGTERM then drains and stops it.
          lifecycle:
            preStop:
              exec:
                command: ["tandem", "deregister", "--port={{ $g.port }}"]
          # grpc.health.v1 on the worker's port: SERVING once the model is loaded and warm,
          # NOT_SERVING while it drains.
          startupProbe:
            grpc: {port: {{ $g.port }}}
            periodSeconds: 5
            failureThreshold: {{ div $g.startupSeconds 5 | max 1 }}
          readinessProbe:
            grpc: {port: {{ $g.port }}}
            periodSeconds: 5
          livenessProbe:
            grpc: {port: {{ $g.port }}}
            periodSeconds: 10
            failureThreshold: 3
          {{- with $g.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          volumeMounts:
            - name: models
              mountPath: /models
              readOnly: true
            {{- if $g.shmSizeLimit }}
            - name: shm
              mountPath: /dev/shm
            {{- end }}
            {{- if $disk.enabled }}
            - name: kv-disk
              mountPath: /kv-disk
            {{- end }}
      volumes:
        - name: models
          persistentVolumeClaim:
            claimName: {{ include "tandem.modelClaim" $ }}
            readOnly: true
        {{- if $g.shmSizeLimit }}
        - name: shm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $g.shmSizeLimit }}
        {{- end }}
        {{- if $disk.enabled }}
        - name: kv-disk
          {{- if $disk.claimName }}
          persistentVolumeClaim:
            claimName: {{ $disk.claimName }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ add (int $disk.sizeGb) 1 }}Gi
          {{- end }}
        {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
---
apiVersion: v1
kind: Service
metadata:
  name: {{ $full }}-{{ $role }}
  labels:
    {{- include "tandem.labels" $ | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  clusterIP: None
  selector:
    {{- $sel | nindent 4 }}
  ports:
    - name: grpc
      port: {{ $g.port }}
      targetPort: grpc
    {{- if eq $role "decode" }}
    - name: kv
      port: {{ $g.kvPort }}
      targetPort: kv
    {{- end }}
{{- if $g.podDisruptionBudget.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $full }}-{{ $role }}
  labels:
    {{- include "tandem.labels" $ | nindent 4 }}
spec:
  maxUnavailable: {{ $g.podDisruptionBudget.maxUnavailable }}
  selector:
    matchLabels:
      {{- $sel | nindent 6 }}
{{- end }}
{{- end -}}
