// Package helm_test checks the Helm chart in tally/ with Helm's own
// packages: it lints clean, it renders with the default and with every part
// on (testdata/full-values.yaml), every object it renders decodes strictly
// into its Kubernetes (or prometheus-operator) type, and the objects hold
// what docs/operations.md ("Helm chart") says of them.
package helm_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	"github.com/stretchr/testify/require"
	"helm.sh/helm/v4/pkg/chart/common"
	"helm.sh/helm/v4/pkg/chart/common/util"
	"helm.sh/helm/v4/pkg/chart/v2/lint"
	"helm.sh/helm/v4/pkg/chart/v2/loader"
	"helm.sh/helm/v4/pkg/engine"
	appsv1 "k8s.io/api/apps/v1"
	batchv1 "k8s.io/api/batch/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	k8syaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

const (
	chartDir   = "tally"
	fullValues = "testdata/full-values.yaml"
	release    = "billing"
	namespace  = "billing"
)

// rendered is what one render made: every object, decoded.
type rendered struct {
	deployment *appsv1.Deployment
	job        *batchv1.Job
	service    *corev1.Service
	pdb        *policyv1.PodDisruptionBudget
	netpol     *networkingv1.NetworkPolicy
	dashboard  *corev1.ConfigMap
	monitor    *monitoringv1.ServiceMonitor
	rule       *monitoringv1.PrometheusRule
	manifests  string // every rendered manifest, as text
	kinds      []string
}

// render renders the chart as `helm install` would, with vals over the
// chart's values, strictly (a value a template reads must exist), and
// decodes every object.
func render(t *testing.T, vals map[string]any) rendered {
	t.Helper()
	out, err := renderFiles(vals)
	require.NoError(t, err)
	var r rendered
	names := make([]string, 0, len(out))
	for name := range out {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if path.Ext(name) != ".yaml" {
			continue
		}
		r.manifests += out[name]
		rd := k8syaml.NewYAMLReader(bufio.NewReader(strings.NewReader(out[name] + "\n")))
		for {
			doc, err := rd.Read()
			if errors.Is(err, io.EOF) {
				break
			}
			require.NoError(t, err, name)
			if len(bytes.TrimSpace(doc)) == 0 || isComments(doc) {
				continue
			}
			r.decode(t, name, doc)
		}
	}
	return r
}

// renderFiles renders every template of the chart with vals.
func renderFiles(vals map[string]any) (map[string]string, error) {
	ch, err := loader.Load(chartDir)
	if err != nil {
		return nil, err
	}
	top, err := util.ToRenderValues(ch, vals, common.ReleaseOptions{
		Name: release, Namespace: namespace, Revision: 1, IsInstall: true,
	}, common.DefaultCapabilities)
	if err != nil {
		return nil, err
	}
	return engine.Engine{Strict: true}.RenderWithContext(context.Background(), ch, top)
}

// isComments reports whether a document holds nothing but comments.
func isComments(doc []byte) bool {
	for line := range strings.Lines(string(doc)) {
		if l := strings.TrimSpace(line); l != "" && !strings.HasPrefix(l, "#") {
			return false
		}
	}
	return true
}

// decode decodes one object strictly into its type: a field its type does
// not have, or a key given twice, fails the test. A kind the test does not
// know fails too.
func (r *rendered) decode(t *testing.T, name string, doc []byte) {
	t.Helper()
	var tm metav1.TypeMeta
	require.NoError(t, yaml.Unmarshal(doc, &tm), name)
	var obj any
	switch tm.APIVersion + "/" + tm.Kind {
	case "apps/v1/Deployment":
		require.Nil(t, r.deployment, "two Deployments")
		r.deployment = &appsv1.Deployment{}
		obj = r.deployment
	case "batch/v1/Job":
		require.Nil(t, r.job, "two Jobs")
		r.job = &batchv1.Job{}
		obj = r.job
	case "v1/Service":
		r.service = &corev1.Service{}
		obj = r.service
	case "policy/v1/PodDisruptionBudget":
		r.pdb = &policyv1.PodDisruptionBudget{}
		obj = r.pdb
	case "networking.k8s.io/v1/NetworkPolicy":
		r.netpol = &networkingv1.NetworkPolicy{}
		obj = r.netpol
	case "v1/ConfigMap":
		r.dashboard = &corev1.ConfigMap{}
		obj = r.dashboard
	case "monitoring.coreos.com/v1/ServiceMonitor":
		r.monitor = &monitoringv1.ServiceMonitor{}
		obj = r.monitor
	case "monitoring.coreos.com/v1/PrometheusRule":
		r.rule = &monitoringv1.PrometheusRule{}
		obj = r.rule
	default:
		t.Fatalf("%s renders %s %s, which the test does not decode", name, tm.APIVersion, tm.Kind)
	}
	require.NoError(t, yaml.UnmarshalStrict(doc, obj), "%s: %s", name, tm.Kind)
	r.kinds = append(r.kinds, tm.Kind)
}

// values reads a values file as `helm install -f` does.
func values(t *testing.T, file string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	vals, err := loader.LoadValues(bytes.NewReader(b))
	require.NoError(t, err)
	return vals
}

// Helm's linter finds nothing, not even a recommendation, with the default
// values and with every part on.
func TestChartLintsClean(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		vals map[string]any
	}{{"default", map[string]any{}}, {"full", values(t, fullValues)}} {
		l := lint.RunAll(chartDir, c.vals, namespace)
		for _, m := range l.Messages {
			t.Errorf("%s values: %s", c.name, m)
		}
	}
}

// The default values render the nodes, their Service and disruption
// budget and the migration hook; the optional parts are off.
func TestDefaultValuesRender(t *testing.T) {
	t.Parallel()
	r := render(t, nil)
	require.ElementsMatch(t, []string{"Deployment", "Job", "Service", "PodDisruptionBudget"}, r.kinds)
	d := r.deployment
	require.Equal(t, int32(2), *d.Spec.Replicas)
	spread := d.Spec.Template.Spec.TopologySpreadConstraints
	require.Len(t, spread, 1)
	require.Equal(t, "kubernetes.io/hostname", spread[0].TopologyKey)
	require.True(t, selects(spread[0].LabelSelector.MatchLabels, d.Spec.Template.Labels))
	require.Equal(t, "ghcr.io/tallymeter/tally:"+appVersion(t), d.Spec.Template.Spec.Containers[0].Image)
	checkServing(t, r, "http", corev1.URISchemeHTTP)
	checkSecurity(t, d.Spec.Template.Spec)
	checkSecurity(t, r.job.Spec.Template.Spec)
	checkMigrationHook(t, r)
	checkSecretsByReference(t, r)

	env := envOf(t, d.Spec.Template.Spec.Containers[0])
	require.Equal(t, map[string]string{
		"TALLY_LISTEN":            ":8080",
		"TALLY_DATABASE_POOLED":   "false",
		"TALLY_DATABASE_URL_FILE": "/etc/tally/secrets/tally-database-url",
		"STRIPE_API_KEY_FILE":     "/etc/tally/secrets/stripe-api-key",
	}, env)
	require.Equal(t, map[string]string{"tally-database-url": "tally-database/url", "stripe-api-key": "tally-stripe/api-key"},
		projected(t, d.Spec.Template.Spec))
	// The Job migrates as the owner, whose URL the nodes never see.
	require.Equal(t, map[string]string{"tally-database-url": "tally-database/owner-url"}, projected(t, r.job.Spec.Template.Spec))
	require.Equal(t, []string{"migrate"}, r.job.Spec.Template.Spec.Containers[0].Args)

	// A single-role install: the Job migrates as the nodes' role.
	r = render(t, map[string]any{"database": map[string]any{"ownerUrl": map[string]any{"secretName": ""}}})
	require.Equal(t, map[string]string{"tally-database-url": "tally-database/url"}, projected(t, r.job.Spec.Template.Spec))
}

// Every part on: the objects decode, TLS comes from its Secret, the
// monitoring objects carry the repository's alerts and dashboard.
func TestFullValuesRender(t *testing.T) {
	t.Parallel()
	r := render(t, values(t, fullValues))
	require.ElementsMatch(t, []string{"Deployment", "Job", "Service", "PodDisruptionBudget", "NetworkPolicy",
		"ConfigMap", "ServiceMonitor", "PrometheusRule"}, r.kinds)
	d := r.deployment
	pod := d.Spec.Template.Spec
	require.Equal(t, int32(3), *d.Spec.Replicas)
	require.Equal(t, "topology.kubernetes.io/zone", pod.TopologySpreadConstraints[0].TopologyKey)
	require.Equal(t, "registry.example.com/billing/tally:0.1.0-test", pod.Containers[0].Image)
	checkServing(t, r, "https", corev1.URISchemeHTTPS)
	checkSecurity(t, pod)
	checkSecurity(t, r.job.Spec.Template.Spec)
	checkMigrationHook(t, r)
	checkSecretsByReference(t, r)

	env := envOf(t, pod.Containers[0])
	require.Equal(t, "true", env["TALLY_DATABASE_POOLED"])
	require.Equal(t, "stripe_meter_event_stream", env["TALLY_EXPORTER"])
	require.Equal(t, "12", env["TALLY_POOL_INGEST"])
	require.Equal(t, "1000000", env["TALLY_INGEST_EVENTS_BURST"])
	require.Equal(t, map[string]string{
		"tally-database-url":        "tally-db-runtime/url",
		"tally-database-direct-url": "tally-db-runtime/direct-url",
		"stripe-api-key":            "tally-stripe/api-key",
		"stripe-webhook-secret":     "tally-stripe/webhook-secret",
		"tally-admin-token":         "tally-admin/token",
	}, projected(t, pod))
	// The nodes never see the owner's URL; the Job sees only it.
	require.Equal(t, map[string]string{"tally-database-url": "tally-db-owner/url"}, projected(t, r.job.Spec.Template.Spec))
	require.Equal(t, []string{"migrate", "--grant-runtime", "tally_app"}, r.job.Spec.Template.Spec.Containers[0].Args)
	require.Equal(t, "true", envOf(t, r.job.Spec.Template.Spec.Containers[0])["TALLY_DATABASE_POOLED"])

	// TLS: the pair from the Secret, mounted as a directory (a subPath
	// mount would never see a renewal).
	require.Equal(t, "/etc/tally/tls/tls.crt", env["TALLY_TLS_CERT"])
	require.Equal(t, "/etc/tally/tls/tls.key", env["TALLY_TLS_KEY"])
	tls := volume(t, pod, "tls")
	require.Equal(t, "tally-tls", tls.Secret.SecretName)
	for _, m := range pod.Containers[0].VolumeMounts {
		require.Empty(t, m.SubPath, m.Name)
		if m.Name == "tls" {
			require.Equal(t, "/etc/tally/tls", m.MountPath)
		}
	}

	// Monitoring: the ServiceMonitor scrapes the Service's port over TLS;
	// the rule's groups are alerts.yml's; the dashboard is tally.json.
	require.Len(t, r.monitor.Spec.Endpoints, 1)
	ep := r.monitor.Spec.Endpoints[0]
	require.Equal(t, r.service.Spec.Ports[0].Name, ep.Port)
	require.Equal(t, "/metrics", ep.Path)
	require.Equal(t, "https", string(*ep.Scheme))
	require.NotNil(t, ep.TLSConfig)
	require.True(t, selects(r.monitor.Spec.Selector.MatchLabels, r.service.Labels), "the ServiceMonitor selects the Service")
	require.Equal(t, "prometheus", r.monitor.Labels["release"])

	var want monitoringv1.PrometheusRuleSpec
	src, err := os.ReadFile("../prometheus/alerts.yml")
	require.NoError(t, err)
	require.NoError(t, yaml.UnmarshalStrict(src, &want), "alerts.yml into a PrometheusRule's spec")
	require.NotEmpty(t, want.Groups)
	require.Equal(t, want, r.rule.Spec, "the PrometheusRule's groups are alerts.yml's")

	dash, err := os.ReadFile("../grafana/tally.json")
	require.NoError(t, err)
	require.Equal(t, string(dash), r.dashboard.Data["tally.json"])
	require.Equal(t, "1", r.dashboard.Labels["grafana_dashboard"])

	// The NetworkPolicy selects the nodes, not the migration Job, and lets
	// in only the node's port.
	np := r.netpol.Spec
	require.True(t, selects(np.PodSelector.MatchLabels, d.Spec.Template.Labels))
	require.False(t, selects(np.PodSelector.MatchLabels, r.job.Spec.Template.Labels))
	require.ElementsMatch(t, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress, networkingv1.PolicyTypeEgress}, np.PolicyTypes)
	require.Len(t, np.Ingress, 1)
	require.Equal(t, "https", np.Ingress[0].Ports[0].Port.String())
	require.Len(t, np.Egress, 4)
}

// Secrets never come from values: a secret setting (or its _FILE) in
// config, a chart without the database's Secret, or a direct URL without
// a pooler is refused at render, naming what to do.
func TestRenderRefusesSecretsInValues(t *testing.T) {
	t.Parallel()
	for _, s := range secretSettings(t) {
		for _, name := range []string{s, s + "_FILE"} {
			_, err := renderFiles(map[string]any{"config": map[string]any{name: "x"}})
			require.ErrorContains(t, err, "config."+name+": a secret setting comes from an existing Secret")
		}
	}
	_, err := renderFiles(map[string]any{"config": map[string]any{"TALLY_LISTEN": ":9090"}})
	require.ErrorContains(t, err, "config.TALLY_LISTEN: the chart sets it")
	_, err = renderFiles(map[string]any{"database": map[string]any{"url": map[string]any{"secretName": ""}}})
	require.ErrorContains(t, err, "database.url.secretName")
	_, err = renderFiles(map[string]any{"database": map[string]any{"directUrl": map[string]any{"secretName": "db"}}})
	require.ErrorContains(t, err, "database.directUrl is only for a pooled database")
}

// values.schema.json refuses a value the chart does not read (a misspelt
// secret would otherwise leave its setting unset without a word) and one
// it cannot use.
func TestValuesSchemaRefusesBadValues(t *testing.T) {
	t.Parallel()
	for _, vals := range []map[string]any{
		{"stripe": map[string]any{"apikey": map[string]any{"secretName": "s", "key": "k"}}},
		{"database": map[string]any{"url": map[string]any{"secretName": "s", "key": "k", "value": "postgres://"}}},
		{"replica": 3},
		{"config": map[string]any{"tally_exporter": "x"}},
		{"preStopSeconds": 0},
		{"image": map[string]any{"digest": "latest"}},
	} {
		_, err := renderFiles(vals)
		require.ErrorContains(t, err, "values don't meet the specifications of the schema", "%v", vals)
	}
}

// The chart's copies of the alerts and the dashboard (Helm reads no file
// outside the chart) are the repository's.
func TestChartFilesAreTheirSources(t *testing.T) {
	t.Parallel()
	for dup, src := range map[string]string{
		"tally/files/alerts.yml": "../prometheus/alerts.yml",
		"tally/files/tally.json": "../grafana/tally.json",
	} {
		a, err := os.ReadFile(src)
		require.NoError(t, err)
		b, err := os.ReadFile(dup)
		require.NoError(t, err)
		require.True(t, bytes.Equal(a, b), "%s differs from %s: cp deploy/%s deploy/helm/%s", dup, src, src[3:], dup)
	}
}

// checkServing checks the nodes and how they are reached and stopped: a
// rolling update that keeps capacity, the probes on the node's port, a
// preStop and a grace long enough for the sends in flight to end, the
// Service and the disruption budget on the same pods.
func checkServing(t *testing.T, r rendered, port string, scheme corev1.URIScheme) {
	t.Helper()
	d := r.deployment
	require.Equal(t, appsv1.RollingUpdateDeploymentStrategyType, d.Spec.Strategy.Type)
	require.Equal(t, "0", d.Spec.Strategy.RollingUpdate.MaxUnavailable.String())
	require.True(t, selects(d.Spec.Selector.MatchLabels, d.Spec.Template.Labels))
	pod := d.Spec.Template.Spec
	require.False(t, *pod.AutomountServiceAccountToken)
	require.False(t, *pod.EnableServiceLinks)
	require.Len(t, pod.Containers, 1)
	c := pod.Containers[0]
	require.Equal(t, []string{"serve"}, c.Args)
	require.Equal(t, []corev1.ContainerPort{{Name: port, ContainerPort: 8080, Protocol: corev1.ProtocolTCP}}, c.Ports)
	probe := func(p *corev1.Probe, path string) {
		t.Helper()
		require.NotNil(t, p)
		require.Equal(t, path, p.HTTPGet.Path)
		require.Equal(t, port, p.HTTPGet.Port.String())
		require.Equal(t, scheme, p.HTTPGet.Scheme)
	}
	probe(c.LivenessProbe, "/healthz")
	probe(c.StartupProbe, "/healthz")
	probe(c.ReadinessProbe, "/readyz?scope=ingest")
	require.False(t, c.Resources.Requests.Memory().IsZero())
	require.False(t, c.Resources.Limits.Memory().IsZero())

	// The image has no shell: the kubelet sleeps. Then SIGTERM: the
	// sends in flight end within nine tenths of a lease and the HTTP
	// server's and River's stops within the shutdown timeout.
	require.NotNil(t, c.Lifecycle.PreStop.Sleep)
	preStop := time.Duration(c.Lifecycle.PreStop.Sleep.Seconds) * time.Second
	require.Positive(t, preStop)
	grace := time.Duration(*pod.TerminationGracePeriodSeconds) * time.Second
	lease, shutdown := documentedDefault(t, "TALLY_OUTBOX_LEASE"), documentedDefault(t, "TALLY_SHUTDOWN_TIMEOUT")
	require.GreaterOrEqual(t, grace, preStop+lease, "the grace must cover preStop and a lease")
	require.GreaterOrEqual(t, grace, preStop+shutdown)

	s := r.service.Spec
	require.True(t, selects(s.Selector, d.Spec.Template.Labels))
	require.Len(t, s.Ports, 1)
	require.Equal(t, port, s.Ports[0].Name)
	require.Equal(t, port, s.Ports[0].TargetPort.String())

	require.True(t, selects(r.pdb.Spec.Selector.MatchLabels, d.Spec.Template.Labels))
	require.Equal(t, "1", r.pdb.Spec.MaxUnavailable.String())
}

// checkSecurity checks the restricted security context of every container
// of pod (Pod Security Standards' "restricted", and a read-only root).
func checkSecurity(t *testing.T, pod corev1.PodSpec) {
	t.Helper()
	ps := pod.SecurityContext
	require.NotNil(t, ps)
	require.True(t, *ps.RunAsNonRoot)
	require.NotZero(t, *ps.RunAsUser)
	require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, ps.SeccompProfile.Type)
	require.Empty(t, pod.InitContainers)
	for _, c := range pod.Containers {
		sc := c.SecurityContext
		require.NotNil(t, sc, c.Name)
		require.True(t, *sc.RunAsNonRoot, c.Name)
		require.True(t, *sc.ReadOnlyRootFilesystem, c.Name)
		require.False(t, *sc.AllowPrivilegeEscalation, c.Name)
		require.False(t, *sc.Privileged, c.Name)
		require.Equal(t, []corev1.Capability{"ALL"}, sc.Capabilities.Drop, c.Name)
		require.Empty(t, sc.Capabilities.Add, c.Name)
		require.Equal(t, corev1.SeccompProfileTypeRuntimeDefault, sc.SeccompProfile.Type, c.Name)
	}
}

// checkMigrationHook checks that tally migrate runs as a Job Helm runs and
// waits for before the install and every upgrade, with the nodes' image.
func checkMigrationHook(t *testing.T, r rendered) {
	t.Helper()
	j := r.job
	require.Equal(t, "pre-install,pre-upgrade", j.Annotations["helm.sh/hook"])
	require.Contains(t, strings.Split(j.Annotations["helm.sh/hook-delete-policy"], ","), "before-hook-creation")
	require.NotContains(t, r.deployment.Annotations, "helm.sh/hook")
	pod := j.Spec.Template.Spec
	require.Equal(t, corev1.RestartPolicyNever, pod.RestartPolicy)
	require.Len(t, pod.Containers, 1)
	c, node := pod.Containers[0], r.deployment.Spec.Template.Spec.Containers[0]
	require.Equal(t, "migrate", c.Args[0])
	require.Equal(t, node.Image, c.Image)
	require.Equal(t, node.Command, c.Command)
	require.Contains(t, envOf(t, c), "TALLY_DATABASE_URL_FILE")
	require.NotNil(t, j.Spec.ActiveDeadlineSeconds)
}

// checkSecretsByReference checks that every secret reaches the pods as a
// file of an existing Secret named by the setting's _FILE variable — a
// name cmd/tally/config knows — never as a value, an env reference or a
// Secret of the chart's; and that no rendered manifest holds anything
// that looks like a key, a signing secret or a database URL.
func checkSecretsByReference(t *testing.T, r rendered) {
	t.Helper()
	secrets := secretSettings(t)
	require.NotContains(t, r.kinds, "Secret")
	for _, pod := range []corev1.PodSpec{r.deployment.Spec.Template.Spec, r.job.Spec.Template.Spec} {
		files := projected(t, pod)
		for _, c := range pod.Containers {
			require.Empty(t, c.EnvFrom, c.Name)
			var dir string
			for _, m := range c.VolumeMounts {
				if m.Name == "secrets" {
					dir = m.MountPath
					require.True(t, m.ReadOnly)
				}
			}
			require.NotEmpty(t, dir, "%s mounts no secrets", c.Name)
			for _, e := range c.Env {
				require.Nil(t, e.ValueFrom, "%s: %s", c.Name, e.Name)
				require.NotContains(t, secrets, e.Name, "%s: a secret as a value", c.Name)
				base, isFile := strings.CutSuffix(e.Name, "_FILE")
				if !isFile {
					require.True(t, documented(t, e.Name), "%s: %s is no setting of docs/configuration.md", c.Name, e.Name)
					continue
				}
				require.Contains(t, secrets, base, "%s: cmd/tally/config reads no %s", c.Name, e.Name)
				file, ok := strings.CutPrefix(e.Value, dir+"/")
				require.True(t, ok, "%s: %s=%s is outside %s", c.Name, e.Name, e.Value, dir)
				require.Contains(t, files, file, "%s: %s names no projected key", c.Name, e.Name)
			}
		}
	}
	for _, re := range []string{`sk_(live|test)_`, `rk_(live|test)_`, `whsec_`, `postgres(ql)?://`, `(?i)password`} {
		require.NotRegexp(t, re, r.manifests)
	}
}

// envOf is a container's environment, each variable once.
func envOf(t *testing.T, c corev1.Container) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, e := range c.Env {
		require.NotContains(t, env, e.Name, "%s: twice in the environment", c.Name)
		env[e.Name] = e.Value
	}
	return env
}

// projected maps each file of the pod's secrets volume to the Secret and
// key it holds ("secret/key"), checking that only the pod's group may read
// them.
func projected(t *testing.T, pod corev1.PodSpec) map[string]string {
	t.Helper()
	v := volume(t, pod, "secrets")
	require.NotNil(t, v.Projected)
	require.Equal(t, int32(0o440), *v.Projected.DefaultMode)
	files := map[string]string{}
	for _, src := range v.Projected.Sources {
		require.NotNil(t, src.Secret, "only Secrets are projected")
		for _, it := range src.Secret.Items {
			require.NotContains(t, files, it.Path)
			files[it.Path] = src.Secret.Name + "/" + it.Key
		}
	}
	return files
}

// volume is the pod's volume of that name.
func volume(t *testing.T, pod corev1.PodSpec, name string) corev1.Volume {
	t.Helper()
	for _, v := range pod.Volumes {
		if v.Name == name {
			return v
		}
	}
	t.Fatalf("no volume %s", name)
	return corev1.Volume{}
}

// selects reports whether a selector's labels are all among labels.
func selects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

// appVersion is the chart's appVersion.
func appVersion(t *testing.T) string {
	t.Helper()
	ch, err := loader.Load(chartDir)
	require.NoError(t, err)
	return ch.Metadata.AppVersion
}

// secretSettings are the settings cmd/tally/config reads from <VAR>_FILE,
// read from its source (this module does not import Tally's).
func secretSettings(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile("../../cmd/tally/config/settings_secrets.go")
	require.NoError(t, err)
	m := regexp.MustCompile(`secretSettings = \[\]string\{([^}]*)\}`).FindSubmatch(b)
	require.NotNil(t, m, "secretSettings not found in cmd/tally/config/settings_secrets.go")
	var out []string
	for _, q := range regexp.MustCompile(`"([A-Z_]+)"`).FindAllSubmatch(m[1], -1) {
		out = append(out, string(q[1]))
	}
	require.Contains(t, out, "TALLY_DATABASE_URL")
	return out
}

// configurationTable is docs/configuration.md, whose table
// cmd/tally/config's test keeps equal to the settings.
func configurationTable(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("../../docs/configuration.md")
	require.NoError(t, err)
	return string(b)
}

// documented reports whether env is a setting of docs/configuration.md.
func documented(t *testing.T, env string) bool {
	return strings.Contains(configurationTable(t), "\n| `"+env+"` |")
}

// documentedDefault is a duration setting's default as
// docs/configuration.md gives it.
func documentedDefault(t *testing.T, env string) time.Duration {
	t.Helper()
	m := regexp.MustCompile("\n\\| `" + env + "` \\| `[^`]+` \\| `([^`]+)` \\|").FindStringSubmatch(configurationTable(t))
	require.NotNil(t, m, "%s has no row in docs/configuration.md", env)
	d, err := time.ParseDuration(m[1])
	require.NoError(t, err, env)
	return d
}
