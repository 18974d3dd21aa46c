{{/* tally.name is the chart's name, or nameOverride. */}}
{{- define "tally.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* tally.fullname names the release's objects: the release's name, with
the chart's unless it holds it already. */}}
{{- define "tally.fullname" -}}
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

{{/* tally.migrationName names the migration Job, within the 63
characters of the label Kubernetes gives its pods. */}}
{{- define "tally.migrationName" -}}
{{- printf "%s-migrate" (include "tally.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{/* tally.selectorLabels select the release's serving pods. */}}
{{- define "tally.selectorLabels" -}}
app.kubernetes.io/name: {{ include "tally.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: server
{{- end }}

{{/* tally.labels are every object's labels, less the component. */}}
{{- define "tally.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "tally.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* tally.image is the image's reference: the digest when set, else the
tag, which defaults to the chart's appVersion. */}}
{{- define "tally.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* tally.secretsDir is where the secrets' files are mounted. */}}
{{- define "tally.secretsDir" -}}/etc/tally/secrets{{- end }}

{{/* tally.secretRefs is a JSON list of the secret settings the serving
pods read from files: the setting, its Secret and key, and the file. The
database URL is required; the others are left unset without a Secret. */}}
{{- define "tally.secretRefs" -}}
{{- $v := .Values }}
{{- $refs := list }}
{{- $_ := required "database.url.secretName: the Secret holding the runtime role's database URL" $v.database.url.secretName }}
{{- $refs = append $refs (dict "env" "TALLY_DATABASE_URL" "ref" $v.database.url) }}
{{- if $v.database.directUrl.secretName }}
{{- if not $v.database.pooled }}
{{- fail "database.directUrl is only for a pooled database (database.pooled: true): TALLY_DATABASE_DIRECT_URL reaches Postgres past the pooler" }}
{{- end }}
{{- $refs = append $refs (dict "env" "TALLY_DATABASE_DIRECT_URL" "ref" $v.database.directUrl) }}
{{- end }}
{{- if $v.stripe.apiKey.secretName }}
{{- $refs = append $refs (dict "env" "STRIPE_API_KEY" "ref" $v.stripe.apiKey) }}
{{- end }}
{{- if $v.stripe.webhookSecret.secretName }}
{{- $refs = append $refs (dict "env" "STRIPE_WEBHOOK_SECRET" "ref" $v.stripe.webhookSecret) }}
{{- end }}
{{- if $v.adminToken.secretName }}
{{- $refs = append $refs (dict "env" "TALLY_ADMIN_TOKEN" "ref" $v.adminToken) }}
{{- end }}
{{- include "tally.fileRefs" $refs }}
{{- end }}

{{/* tally.migrationSecretRefs: the migration Job reads the owner's URL,
or the runtime role's on a single-role install. */}}
{{- define "tally.migrationSecretRefs" -}}
{{- $v := .Values }}
{{- $ref := $v.database.url }}
{{- if $v.database.ownerUrl.secretName }}
{{- $ref = $v.database.ownerUrl }}
{{- end }}
{{- $_ := required "database.url.secretName: the Secret holding the runtime role's database URL" $v.database.url.secretName }}
{{- include "tally.fileRefs" (list (dict "env" "TALLY_DATABASE_URL" "ref" $ref)) }}
{{- end }}

{{/* tally.fileRefs turns a list of {env, ref} into the JSON list of
tally.secretRefs, each file named after its setting. */}}
{{- define "tally.fileRefs" -}}
{{- $out := list }}
{{- range . }}
{{- $key := required (printf "the key of the Secret %s, for %s" .ref.secretName .env) .ref.key }}
{{- $file := .env | lower | replace "_" "-" }}
{{- $out = append $out (dict "env" .env "secretName" .ref.secretName "key" $key "file" $file) }}
{{- end }}
{{- toJson $out }}
{{- end }}

{{/* tally.secretEnv is the _FILE variables of a tally.secretRefs list. */}}
{{- define "tally.secretEnv" -}}
{{- range . }}
- name: {{ .env }}_FILE
  value: {{ printf "%s/%s" (include "tally.secretsDir" nil) .file | quote }}
{{- end }}
{{- end }}

{{/* tally.secretVolume projects the keys of a tally.secretRefs list into
one directory, readable by the pod's group (fsGroup) only. */}}
{{- define "tally.secretVolume" -}}
- name: secrets
  projected:
    defaultMode: 0440
    sources:
      {{- range . }}
      - secret:
          name: {{ .secretName }}
          items:
            - key: {{ .key | quote }}
              path: {{ .file }}
      {{- end }}
{{- end }}

{{/* tally.configEnv is config's settings, refusing the secret ones (they
come from Secrets) and those the chart sets itself. */}}
{{- define "tally.configEnv" -}}
{{- $secret := list "STRIPE_API_KEY" "STRIPE_WEBHOOK_SECRET" "TALLY_ADMIN_TOKEN" "TALLY_DATABASE_URL" "TALLY_DATABASE_OWNER_URL" "TALLY_DATABASE_DIRECT_URL" "TALLY_ARCHIVE_SECRET_KEY" }}
{{- $chart := list "TALLY_LISTEN" "TALLY_DATABASE_POOLED" "TALLY_TLS_CERT" "TALLY_TLS_KEY" }}
{{- range $name := keys .Values.config | sortAlpha }}
{{- if or (has $name $secret) (has (trimSuffix "_FILE" $name) $secret) }}
{{- fail (printf "config.%s: a secret setting comes from an existing Secret (database, stripe, adminToken), never from values" $name) }}
{{- end }}
{{- if has $name $chart }}
{{- fail (printf "config.%s: the chart sets it (service, database.pooled, tls)" $name) }}
{{- end }}
{{- $value := index $.Values.config $name }}
{{- if and (kindIs "float64" $value) (eq $value (floor $value)) }}
{{- /* A whole number from a values file, which YAML gives as a float:
1000000, not 1e+06. */}}
{{- $value = int64 $value }}
{{- end }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- end }}

{{/* tally.scheme is the node's: HTTPS with tls.secretName. */}}
{{- define "tally.scheme" -}}
{{- if .Values.tls.secretName }}HTTPS{{ else }}HTTP{{ end }}
{{- end }}

{{/* tally.portName names the node's port after its scheme. */}}
{{- define "tally.portName" -}}
{{- include "tally.scheme" . | lower }}
{{- end }}
