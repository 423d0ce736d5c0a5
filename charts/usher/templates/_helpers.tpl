{{/* Chart name, truncated for label values. */}}
{{- define "usher.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Base name of every object: the release name, or <release>-usher. */}}
{{- define "usher.fullname" -}}
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

{{- define "usher.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "usher.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* Selector labels of one component: include "usher.selectorLabels" (list $ "root") */}}
{{- define "usher.selectorLabels" -}}
{{- $ctx := index . 0 -}}
app.kubernetes.io/name: {{ include "usher.name" $ctx }}
app.kubernetes.io/instance: {{ $ctx.Release.Name }}
app.kubernetes.io/component: {{ index . 1 }}
{{- end }}

{{- define "usher.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* <name>.<namespace>.svc.<clusterDomain> */}}
{{- define "usher.svcSuffix" -}}
{{- printf "%s.svc.%s" .Release.Namespace .Values.clusterDomain }}
{{- end }}

{{/* Comma-separated etcd client URLs: the configured ones, or the chart's etcd. */}}
{{- define "usher.etcdEndpoints" -}}
{{- if and (or .Values.etcd.tls.secretName .Values.etcd.auth.user) (not .Values.etcd.endpoints) }}
{{- fail "etcd.tls and etcd.auth are for an existing etcd: set etcd.endpoints (https:// with etcd.tls)" }}
{{- end }}
{{- if .Values.etcd.endpoints }}
{{- join "," .Values.etcd.endpoints }}
{{- else if .Values.etcd.deploy }}
{{- $fullname := include "usher.fullname" . }}
{{- $suffix := include "usher.svcSuffix" . }}
{{- $urls := list }}
{{- range $i := until (int .Values.etcd.replicas) }}
{{- $urls = append $urls (printf "http://%s-etcd-%d.%s-etcd-headless.%s:2379" $fullname $i $fullname $suffix) }}
{{- end }}
{{- join "," $urls }}
{{- else }}
{{- fail "ha.enabled needs etcd: set etcd.endpoints or etcd.deploy=true" }}
{{- end }}
{{- end }}

{{/* Root replicas: root.replicas, or 1 (3 with ha.enabled). */}}
{{- define "usher.rootReplicas" -}}
{{- .Values.root.replicas | default (ternary 3 1 .Values.ha.enabled) | int }}
{{- end }}

{{/* Replicas per intermediate node: intermediate.replicas, or 1 (2 with ha.enabled). */}}
{{- define "usher.intermediateReplicas" -}}
{{- .Values.intermediate.replicas | default (ternary 2 1 .Values.ha.enabled) | int }}
{{- end }}

{{/* The component the sidecars' Service selects: the intermediates, or the root when there are none. */}}
{{- define "usher.edge" -}}
{{- ternary "intermediate" "root" (gt (len .Values.intermediate.nodes) 0) }}
{{- end }}

{{/* The root replicas' stable addresses, for the intermediates' --parent. */}}
{{- define "usher.rootAddresses" -}}
{{- $fullname := include "usher.fullname" . }}
{{- $suffix := include "usher.svcSuffix" . }}
{{- $addrs := list }}
{{- range $i := until (int (include "usher.rootReplicas" .)) }}
{{- $addrs = append $addrs (printf "%s-root-%d.%s-root-headless.%s:15100" $fullname $i $fullname $suffix) }}
{{- end }}
{{- join "," $addrs }}
{{- end }}

{{/*
The server container, shared by root and intermediates.
include "usher.serverContainer" (dict "ctx" $ "node" "root" "headless" "<svc>" "parent" "" "resources" .Values.root.resources "config" true)
*/}}
{{- define "usher.serverContainer" -}}
{{- $ctx := .ctx -}}
- name: usher
  image: {{ include "usher.image" $ctx }}
  imagePullPolicy: {{ $ctx.Values.image.pullPolicy }}
  args:
    - server
    {{- if .config }}
    - --config=/etc/usher/resources.yaml
    {{- end }}
    - --listen=0.0.0.0:15100
    # The admin port binds 127.0.0.1 by default; probes and Prometheus come
    # from outside the pod.
    - --admin-listen=0.0.0.0:15180
    - --advertise-addr=$(POD_NAME).{{ .headless }}.{{ include "usher.svcSuffix" $ctx }}:15100
    - --min-request-interval={{ $ctx.Values.server.minRequestInterval }}
    {{- if not $ctx.Values.ha.enabled }}
    # until when leases may be outstanding: a restarted container learns them
    # back, a new pod serves at once (with etcd the record is kept there)
    - --state-file=/var/lib/usher/server.state
    {{- end }}
    {{- if .parent }}
    # intermediate mode: any servers of the parent node
    - --parent={{ .parent }}
    {{- end }}
    {{- if $ctx.Values.tls.secretName }}
    # gRPC over TLS; the certificate reloads live when the Secret changes
    - --tls-cert=/etc/usher-tls/tls.crt
    - --tls-key=/etc/usher-tls/tls.key
    {{- if $ctx.Values.tls.clientAuth }}
    - --tls-client-ca=/etc/usher-tls/ca.crt
    {{- end }}
    {{- if .parent }}
    - --parent-tls-ca=/etc/usher-tls/ca.crt
    {{- if $ctx.Values.tls.clientAuth }}
    - --parent-tls-cert=/etc/usher-tls/tls.crt
    - --parent-tls-key=/etc/usher-tls/tls.key
    {{- end }}
    {{- end }}
    {{- end }}
    {{- if $ctx.Values.ha.enabled }}
    # master election on etcd, one key per node
    - --etcd-endpoints={{ include "usher.etcdEndpoints" $ctx }}
    - --election-key={{ $ctx.Values.election.keyPrefix }}/{{ .node }}
    - --election-ttl={{ $ctx.Values.election.ttl }}
    {{- with $ctx.Values.etcd.tls }}
    {{- if .secretName }}
    # TLS to etcd with the CA (and client certificate) of Secret {{ .secretName }}
    - --etcd-ca=/etc/usher-etcd/ca.crt
    {{- if .clientCert }}
    - --etcd-cert=/etc/usher-etcd/tls.crt
    - --etcd-key=/etc/usher-etcd/tls.key
    {{- end }}
    {{- if .serverName }}
    - --etcd-server-name={{ .serverName }}
    {{- end }}
    {{- end }}
    {{- end }}
    {{- if $ctx.Values.etcd.auth.user }}
    - --etcd-user={{ $ctx.Values.etcd.auth.user }}
    {{- end }}
    {{- end }}
  env:
    - name: POD_NAME
      valueFrom: { fieldRef: { fieldPath: metadata.name } }
    - name: USHER_LOG
      value: {{ $ctx.Values.server.logLevel | quote }}
    {{- if and $ctx.Values.ha.enabled $ctx.Values.etcd.auth.user }}
    - name: USHER_ETCD_PASSWORD
      valueFrom:
        secretKeyRef:
          name: {{ required "etcd.auth.user needs etcd.auth.passwordSecret" $ctx.Values.etcd.auth.passwordSecret }}
          key: {{ $ctx.Values.etcd.auth.passwordKey }}
    {{- end }}
  ports:
    - { name: grpc, containerPort: 15100 }
    - { name: admin, containerPort: 15180 }
  readinessProbe:
    httpGet: { path: /readyz, port: admin }
    periodSeconds: 5
  livenessProbe:
    httpGet: { path: /healthz, port: admin }
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml .resources | nindent 4 }}
  securityContext:
    {{- toYaml $ctx.Values.server.securityContext | nindent 4 }}
  {{- $etcdTls := and $ctx.Values.ha.enabled $ctx.Values.etcd.tls.secretName }}
  {{- if or .config $ctx.Values.tls.secretName $etcdTls }}
  volumeMounts:
    {{- if .config }}
    # A directory mount, never subPath: ConfigMap updates must reach the pod.
    - { name: config, mountPath: /etc/usher, readOnly: true }
    {{- end }}
    {{- if not $ctx.Values.ha.enabled }}
    - { name: state, mountPath: /var/lib/usher }
    {{- end }}
    {{- if $ctx.Values.tls.secretName }}
    - { name: tls, mountPath: /etc/usher-tls, readOnly: true }
    {{- end }}
    {{- if $etcdTls }}
    - { name: etcd-tls, mountPath: /etc/usher-etcd, readOnly: true }
    {{- end }}
  {{- end }}
{{- end }}

{{/* The servers' TLS Secret volumes: tls.secretName, and etcd.tls.secretName for etcd. */}}
{{- define "usher.tlsVolume" -}}
{{- if .Values.tls.secretName }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
{{- end }}
{{- if and .Values.ha.enabled .Values.etcd.tls.secretName }}
- name: etcd-tls
  secret:
    secretName: {{ .Values.etcd.tls.secretName }}
{{- end }}
{{- end }}

{{/*
==== usher.sidecar ====================================================

Adds the usher sidecar (`usher proxy`) to an app's pod spec. Renders one
container list item. Arguments, as a dict:

  context          required  the caller's root context ($)
  routesConfigMap  required  name of a ConfigMap with key routes.yaml
  native           optional  true (default): a native sidecar with
                             restartPolicy: Always, to be placed under
                             initContainers (Kubernetes >= 1.29). false: a
                             plain container for `containers`.
  image            optional  default: this chart's image (values image.*)
  resources        optional  default: values sidecar.resources
  adminPort        optional  default: values sidecar.adminPort (15000)
  tlsSecret        optional  a Secret mounted at /etc/usher-tls, for the
                             routes file's doorman.tls (e.g. ca_file:
                             /etc/usher-tls/ca.crt); pass it to
                             usher.sidecarVolumes too

It works both inside this chart and from an app chart that lists usher as a
dependency (it then reads the defaults from .Values.usher). Use it with
usher.sidecarVolumes and usher.sidecarPodLabels:

  spec:
    template:
      metadata:
        labels:
          {{- include "usher.sidecarPodLabels" (dict "context" $) | nindent 10 }}
      spec:
        terminationGracePeriodSeconds: 60
        initContainers:
          {{- include "usher.sidecar" (dict "context" $ "routesConfigMap" "my-app-routes") | nindent 10 }}
        containers:
          - name: app          # calls http://127.0.0.1:15001
        volumes:
          {{- include "usher.sidecarVolumes" (dict "context" $ "routesConfigMap" "my-app-routes") | nindent 10 }}

The routes file should set doorman.client_id: "${POD_NAME}" (POD_NAME comes
from the downward API here) and may set cache_file under /var/run/usher.
Give the pod a terminationGracePeriodSeconds longer than the app's own stop
plus the routes file's drain_timeout plus a few seconds for ReleaseCapacity.
*/}}
{{- define "usher.sidecar" -}}
{{- $ctx := required "usher.sidecar: pass (dict \"context\" $ ...)" .context -}}
{{- $routes := required "usher.sidecar: routesConfigMap is required" .routesConfigMap -}}
{{- $v := $ctx.Values -}}
{{- if and (hasKey $v "usher") (kindIs "map" $v.usher) }}{{ $v = $v.usher }}{{ end -}}
{{- $image := .image | default (printf "%s:%s" $v.image.repository $v.image.tag) -}}
{{- $resources := .resources | default $v.sidecar.resources -}}
{{- $adminPort := .adminPort | default $v.sidecar.adminPort -}}
{{- $native := true }}{{ if hasKey . "native" }}{{ $native = .native }}{{ end -}}
- name: usher
  image: {{ $image }}
  imagePullPolicy: {{ $v.image.pullPolicy | default "IfNotPresent" }}
  {{- if $native }}
  restartPolicy: Always
  {{- end }}
  args:
    - proxy
    - --routes=/etc/usher/routes.yaml
    # Probes come from the kubelet, not loopback; the proxy stays on 127.0.0.1:15001.
    - --admin-listen=0.0.0.0:{{ $adminPort }}
  env:
    - name: POD_NAME
      valueFrom: { fieldRef: { fieldPath: metadata.name } }
    - name: USHER_LOG
      value: {{ $v.sidecar.logLevel | default "info" | quote }}
  ports:
    - { name: usher-admin, containerPort: {{ $adminPort }} }
  startupProbe:
    httpGet: { path: /healthz, port: usher-admin }
    periodSeconds: 1
    failureThreshold: 30
  readinessProbe:
    httpGet: { path: /readyz, port: usher-admin }
    periodSeconds: 5
  livenessProbe:
    httpGet: { path: /healthz, port: usher-admin }
    periodSeconds: 10
    failureThreshold: 3
  resources:
    {{- toYaml $resources | nindent 4 }}
  securityContext:
    runAsNonRoot: true
    runAsUser: 65532
    runAsGroup: 65532
    allowPrivilegeEscalation: false
    readOnlyRootFilesystem: true
    capabilities: { drop: [ALL] }
    seccompProfile: { type: RuntimeDefault }
  volumeMounts:
    - { name: usher-routes, mountPath: /etc/usher, readOnly: true }
    - { name: usher-state, mountPath: /var/run/usher }
    {{- if .tlsSecret }}
    - { name: usher-tls, mountPath: /etc/usher-tls, readOnly: true }
    {{- end }}
{{- end }}

{{/* The sidecar's volumes: include "usher.sidecarVolumes" (dict "context" $ "routesConfigMap" NAME) */}}
{{- define "usher.sidecarVolumes" -}}
{{- $routes := required "usher.sidecarVolumes: routesConfigMap is required" .routesConfigMap -}}
- name: usher-routes
  configMap:
    name: {{ $routes }}
- name: usher-state
  emptyDir: { sizeLimit: 1Mi }
{{- if .tlsSecret }}
- name: usher-tls
  secret:
    secretName: {{ .tlsSecret }}
{{- end }}
{{- end }}

{{/* Labels that let a pod through the servers' NetworkPolicy. */}}
{{- define "usher.sidecarPodLabels" -}}
{{- $v := .context.Values -}}
{{- if and (hasKey $v "usher") (kindIs "map" $v.usher) }}{{ $v = $v.usher }}{{ end -}}
{{- toYaml $v.networkPolicy.sidecarPodLabels }}
{{- end }}
