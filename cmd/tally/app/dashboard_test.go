package app_test

// The Grafana dashboard (deploy/grafana/tally.json) is checked here, beside
// app.Serve, because its main check needs a running node: every metric a
// panel's PromQL names must be one a node really serves on /metrics.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	grafana "github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/stretchr/testify/require"
	"go.yaml.in/yaml/v3"

	"github.com/tallymeter/tally/cmd/tally/app"
	"github.com/tallymeter/tally/cmd/tally/config"
	"github.com/tallymeter/tally/internal/stripesim"
	"github.com/tallymeter/tally/internal/testkit/syncbuf"
	"github.com/tallymeter/tally/internal/testkit/testdb"
)

// Where the dashboard, the alerts and the documents its links point into
// are, from this package's directory.
const (
	dashboardFile = "../../../deploy/grafana/tally.json"
	alertsFile    = "../../../deploy/prometheus/alerts.yml"
	docsDir       = "../../../docs"
)

// grafanaDashboard is what the checks read of a dashboard's JSON.
type grafanaDashboard struct {
	UID           string         `json:"uid"`
	Title         string         `json:"title"`
	SchemaVersion int            `json:"schemaVersion"`
	Links         []grafanaLink  `json:"links"`
	Panels        []grafanaPanel `json:"panels"`
	Templating    struct {
		List []grafanaVariable `json:"list"`
	} `json:"templating"`
}

type grafanaPanel struct {
	ID          int                `json:"id"`
	Type        string             `json:"type"`
	Title       string             `json:"title"`
	Description string             `json:"description"`
	Collapsed   bool               `json:"collapsed"`
	Datasource  *grafanaDatasource `json:"datasource"`
	Targets     []grafanaTarget    `json:"targets"`
	Links       []grafanaLink      `json:"links"`
	// Panels are a row's panels while it is collapsed.
	Panels []grafanaPanel `json:"panels"`
}

type grafanaDatasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type grafanaTarget struct {
	RefID      string             `json:"refId"`
	Expr       string             `json:"expr"`
	Datasource *grafanaDatasource `json:"datasource"`
}

type grafanaLink struct {
	Title string `json:"title"`
	URL   string `json:"url"`
}

// grafanaVariable is a template variable. A query variable's query is a
// string, or (Grafana 10 and later) an object holding it.
type grafanaVariable struct {
	Name       string             `json:"name"`
	Type       string             `json:"type"`
	Query      json.RawMessage    `json:"query"`
	Datasource *grafanaDatasource `json:"datasource"`
}

// queryText is a variable's query as text.
func (v grafanaVariable) queryText() (string, error) {
	if len(v.Query) == 0 {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(v.Query, &s); err == nil {
		return s, nil
	}
	var o struct {
		Query string `json:"query"`
	}
	if err := json.Unmarshal(v.Query, &o); err != nil {
		return "", fmt.Errorf("variable %s: query is neither a string nor an object with one: %w", v.Name, err)
	}
	return o.Query, nil
}

// allPanels is every panel, a collapsed row's own panels included.
func allPanels(ps []grafanaPanel) []grafanaPanel {
	var out []grafanaPanel
	for _, p := range ps {
		out = append(out, p)
		out = append(out, allPanels(p.Panels)...)
	}
	return out
}

// datasourceVariable is the only datasource the dashboard's queries may
// name: the template variable, so that an import picks the Prometheus.
var datasourceVariable = grafanaDatasource{Type: "prometheus", UID: "${datasource}"}

// registerGrafanaPlugins makes the schema check know the panels' options
// and the Prometheus queries, once.
var registerGrafanaPlugins = sync.OnceFunc(plugins.RegisterDefaultPlugins)

// schemaProblems are the ways a dashboard's JSON departs from Grafana's
// dashboard schema (v1, schemaVersion 36 and up), as the Grafana
// Foundation SDK's strict decoding finds them: a field of the wrong type,
// an unknown field (a typo), a required field missing.
func schemaProblems(raw []byte) []string {
	registerGrafanaPlugins()
	//lint:ignore SA1019 the file is the classic model (every Grafana imports it); dashboardv2 is the new resource format, which does not read it
	var d grafana.Dashboard
	err := d.UnmarshalJSONStrict(raw)
	var errs cog.BuildErrors
	if errors.As(err, &errs) {
		// It returns its (possibly empty) list of errors as the error.
		var out []string
		for _, e := range errs {
			out = append(out, "grafana schema: "+e.Error())
		}
		return out
	}
	if err == nil {
		err = d.Validate()
	}
	if err != nil {
		return []string{"grafana schema: " + err.Error()}
	}
	return nil
}

// structureProblems are what is wrong with a dashboard's JSON as a
// dashboard: Grafana's schema, then titles, targets, ids and datasources.
func structureProblems(raw []byte) []string {
	var d grafanaDashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		return []string{fmt.Sprintf("not a dashboard's JSON: %v", err)}
	}
	out := schemaProblems(raw)
	bad := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	if d.Title == "" || d.UID == "" {
		bad("the dashboard has no title or uid")
	}
	if d.SchemaVersion < 36 {
		bad("schemaVersion %d: export it from Grafana 10 or later (36 and up)", d.SchemaVersion)
	}
	var hasDatasource bool
	for _, v := range d.Templating.List {
		if v.Type == "datasource" {
			q, _ := v.queryText()
			hasDatasource = hasDatasource || v.Name == "datasource" && q == "prometheus"
		}
		if v.Type == "query" && (v.Datasource == nil || *v.Datasource != datasourceVariable) {
			bad("variable %s: its datasource must be %+v", v.Name, datasourceVariable)
		}
	}
	if !hasDatasource {
		bad(`no template variable "datasource" of type datasource for Prometheus`)
	}
	panels := allPanels(d.Panels)
	if len(panels) == 0 {
		bad("no panels")
	}
	ids := map[int]string{}
	for _, p := range panels {
		name := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		if p.Title == "" {
			bad("%s has no title", name)
		}
		if p.ID <= 0 {
			bad("%s has no id", name)
		} else if other, dup := ids[p.ID]; dup {
			bad("%s has the id of %q", name, other)
		}
		ids[p.ID] = p.Title
		if p.Type == "row" {
			if len(p.Panels) > 0 && !p.Collapsed {
				bad("%s holds panels but is not collapsed", name)
			}
			continue
		}
		if p.Description == "" {
			bad("%s has no description: say what it means and what to do", name)
		}
		if p.Datasource == nil || *p.Datasource != datasourceVariable {
			bad("%s: datasource must be %+v, not %+v", name, datasourceVariable, p.Datasource)
		}
		if len(p.Targets) == 0 {
			bad("%s has no target", name)
		}
		for _, tg := range p.Targets {
			if strings.TrimSpace(tg.Expr) == "" {
				bad("%s target %s has no expr", name, tg.RefID)
			}
			if tg.Datasource != nil && *tg.Datasource != datasourceVariable {
				bad("%s target %s: datasource must be %+v", name, tg.RefID, datasourceVariable)
			}
		}
	}
	return out
}

// dashQuery is one PromQL query of a dashboard and where it is.
type dashQuery struct {
	where, expr string
}

// dashboardQueries are every target's expr and every query variable's
// query, with the dashboard's variables substituted as Grafana would. A
// label_values(selector, label) variable is checked as
// count by (label) (selector); query_result(q) as q.
func dashboardQueries(d grafanaDashboard) ([]dashQuery, []string) {
	vars := variableValues(d)
	var out []dashQuery
	var problems []string
	add := func(where, expr string) {
		e, err := interpolate(expr, vars)
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", where, err))
			return
		}
		out = append(out, dashQuery{where: where, expr: e})
	}
	labelValues := regexp.MustCompile(`^\s*label_values\(\s*(.+?)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$`)
	queryResult := regexp.MustCompile(`^\s*query_result\((.+)\)\s*$`)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		where := "variable " + v.Name
		q, err := v.queryText()
		switch m, r := labelValues.FindStringSubmatch(q), queryResult.FindStringSubmatch(q); {
		case err != nil:
			problems = append(problems, err.Error())
		case m != nil:
			add(where, fmt.Sprintf("count by (%s) (%s)", m[2], m[1]))
		case r != nil:
			add(where, r[1])
		default:
			problems = append(problems, fmt.Sprintf("%s: query %q is not label_values(selector, label) or query_result(query), which this test can check", where, q))
		}
	}
	for _, p := range allPanels(d.Panels) {
		for _, tg := range p.Targets {
			add(fmt.Sprintf("panel %d %q target %s", p.ID, p.Title, tg.RefID), tg.Expr)
		}
	}
	return out, problems
}

// variableValues are values Grafana could give the dashboard's variables:
// any value (a regexp) for those a query or a list fills, the text of the
// others.
func variableValues(d grafanaDashboard) map[string]string {
	vars := map[string]string{}
	for _, v := range d.Templating.List {
		switch v.Type {
		case "query", "custom", "interval":
			vars[v.Name] = ".+"
		default:
			vars[v.Name], _ = v.queryText()
		}
	}
	return vars
}

// Grafana's built-in variables, with values a range query might get.
var builtinVariables = map[string]string{
	"__rate_interval": "1m", "__interval": "30s", "__range": "6h", "__range_s": "21600", "__interval_ms": "30000",
}

var variableRE = regexp.MustCompile(`\$\{(\w+)(?::[^}]*)?\}|\[\[(\w+)(?::[^\]]*)?\]\]|\$(\w+)`)

// interpolate substitutes the dashboard's variables and Grafana's built-in
// ones in expr. $1 and the like are left as they are (label_replace's
// references); any other unknown variable is an error, since Grafana would
// leave it in the query.
func interpolate(expr string, vars map[string]string) (string, error) {
	var unknown []string
	out := variableRE.ReplaceAllStringFunc(expr, func(m string) string {
		sm := variableRE.FindStringSubmatch(m)
		name := sm[1] + sm[2] + sm[3]
		if v, ok := vars[name]; ok {
			return v
		}
		if v, ok := builtinVariables[name]; ok {
			return v
		}
		if strings.Trim(name, "0123456789") != "" {
			unknown = append(unknown, m)
		}
		return m
	})
	if len(unknown) > 0 {
		return "", fmt.Errorf("unknown variable %s in %q", strings.Join(unknown, ", "), expr)
	}
	return out, nil
}

// exposition is what a scrape of /metrics holds, by the series name
// Prometheus stores: a counter's name as exposed, a histogram's _bucket,
// _sum and _count, a summary's name, _sum and _count.
type exposition map[string]*seriesInfo

type seriesInfo struct {
	counter bool
	// values are each label's values seen.
	values map[string]map[string]bool
}

func (e exposition) add(name string, counter bool, ls []labelPair) {
	s := e[name]
	if s == nil {
		s = &seriesInfo{counter: counter, values: map[string]map[string]bool{}}
		e[name] = s
	}
	for _, l := range ls {
		if s.values[l.name] == nil {
			s.values[l.name] = map[string]bool{}
		}
		s.values[l.name][l.value] = true
	}
}

type labelPair struct{ name, value string }

// parseExposition reads the Prometheus text format.
func parseExposition(r io.Reader) (exposition, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	families, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, err
	}
	e := exposition{}
	for name, f := range families {
		for _, m := range f.GetMetric() {
			var ls []labelPair
			for _, l := range m.GetLabel() {
				ls = append(ls, labelPair{l.GetName(), l.GetValue()})
			}
			switch f.GetType().String() {
			case "COUNTER":
				e.add(name, true, ls)
			case "HISTOGRAM":
				for _, b := range m.GetHistogram().GetBucket() {
					e.add(name+"_bucket", true, append(slices.Clone(ls), labelPair{"le", model.FloatString(b.GetUpperBound()).String()}))
				}
				e.add(name+"_bucket", true, append(slices.Clone(ls), labelPair{"le", "+Inf"}))
				e.add(name+"_sum", true, ls)
				e.add(name+"_count", true, ls)
			case "SUMMARY":
				for _, q := range m.GetSummary().GetQuantile() {
					e.add(name, false, append(slices.Clone(ls), labelPair{"quantile", model.FloatString(q.GetQuantile()).String()}))
				}
				e.add(name+"_sum", true, ls)
				e.add(name+"_count", true, ls)
			default: // GAUGE, UNTYPED
				e.add(name, false, ls)
			}
		}
	}
	return e, nil
}

// targetLabels are the labels Prometheus adds to every scraped series.
var targetLabels = map[string]bool{"instance": true, "job": true}

// counterFunctions are the functions a counter is read through.
var counterFunctions = map[string]bool{"rate": true, "irate": true, "increase": true, "resets": true}

var promql = parser.NewParser(parser.Options{})

// exprProblems are what is wrong with one PromQL query against what a node
// exposes: it does not parse; it names a metric the node does not serve, a
// label its series do not carry, or a label value (of =) never seen; it
// reads a counter other than through rate() or increase(), or a gauge
// through them; a histogram_quantile() reads no _bucket or drops le.
func exprProblems(expr string, exp exposition) []string {
	ast, err := promql.ParseExpr(expr)
	if err != nil {
		return []string{fmt.Sprintf("invalid PromQL: %v", err)}
	}
	var out []string
	bad := func(format string, args ...any) { out = append(out, fmt.Sprintf(format, args...)) }
	parser.Inspect(ast, func(node parser.Node, parents []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			out = append(out, selectorProblems(n, parents, exp)...)
		case *parser.AggregateExpr:
			if n.Without || len(n.Grouping) == 0 {
				return nil
			}
			have, exposed := labelsUnder(n.Expr, exp)
			if !exposed {
				return nil // its series are reported missing
			}
			for _, l := range n.Grouping {
				if !have[l] && !targetLabels[l] {
					bad("%s groups by %q, a label none of its series carries", n.Op, l)
				}
			}
		case *parser.Call:
			if n.Func.Name == "histogram_quantile" && len(n.Args) == 2 {
				out = append(out, quantileProblems(n.Args[1])...)
			}
		}
		return nil
	})
	return out
}

// selectorProblems checks one selector: its metric, its matchers, and how
// it is read.
func selectorProblems(n *parser.VectorSelector, parents []parser.Node, exp exposition) []string {
	name := n.Name
	if name == "" {
		return []string{fmt.Sprintf("%s has no metric name", n)}
	}
	s, ok := exp[name]
	if !ok {
		return []string{fmt.Sprintf("%s: the node does not expose %s", n, name)}
	}
	var out []string
	for _, m := range n.LabelMatchers {
		if m.Name == model.MetricNameLabel {
			continue
		}
		values, carried := s.values[m.Name]
		switch {
		case !carried && !targetLabels[m.Name]:
			out = append(out, fmt.Sprintf("%s: %s carries no label %q", n, name, m.Name))
		case carried && m.Type == labels.MatchEqual && m.Value != "" && !values[m.Value]:
			out = append(out, fmt.Sprintf("%s: %s never shows %s=%q (it shows %v)", n, name, m.Name, m.Value, keys(values)))
		}
	}
	through := ""
	if len(parents) >= 2 {
		if _, ok := parents[len(parents)-1].(*parser.MatrixSelector); ok {
			if c, ok := outerCall(parents[:len(parents)-1]); ok {
				through = c.Func.Name
			}
		}
	}
	switch {
	case s.counter && !counterFunctions[through]:
		out = append(out, fmt.Sprintf("%s is a counter: read it through rate() or increase(), not %q", name, through))
	case !s.counter && counterFunctions[through]:
		out = append(out, fmt.Sprintf("%s is a gauge: %s() of it means nothing", name, through))
	}
	return out
}

// outerCall is the call a matrix selector is an argument of, through
// parentheses.
func outerCall(parents []parser.Node) (*parser.Call, bool) {
	for i := len(parents) - 1; i >= 0; i-- {
		switch p := parents[i].(type) {
		case *parser.ParenExpr, parser.Expressions:
			continue
		case *parser.Call:
			return p, true
		default:
			return nil, false
		}
	}
	return nil, false
}

// labelsUnder are the labels the series under e can carry: their own, and
// those label_replace() or label_join() make; exposed is whether exp has
// any of those series.
func labelsUnder(e parser.Node, exp exposition) (have map[string]bool, exposed bool) {
	have = map[string]bool{}
	parser.Inspect(e, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			if s, ok := exp[n.Name]; ok {
				exposed = true
				for l := range s.values {
					have[l] = true
				}
			}
		case *parser.Call:
			if (n.Func.Name == "label_replace" || n.Func.Name == "label_join") && len(n.Args) > 1 {
				if dst, ok := n.Args[1].(*parser.StringLiteral); ok {
					have[dst.Val] = true
				}
			}
		}
		return nil
	})
	return have, exposed
}

// quantileProblems checks histogram_quantile's input: _bucket series, with
// le kept by every aggregation on the way.
func quantileProblems(e parser.Node) []string {
	var out []string
	parser.Inspect(e, func(node parser.Node, _ []parser.Node) error {
		switch n := node.(type) {
		case *parser.VectorSelector:
			if !strings.HasSuffix(n.Name, "_bucket") {
				out = append(out, fmt.Sprintf("histogram_quantile over %s, not a _bucket series", n.Name))
			}
		case *parser.AggregateExpr:
			if slices.Contains(n.Grouping, "le") == n.Without {
				out = append(out, fmt.Sprintf("histogram_quantile over %s, which drops le", n))
			}
		}
		return nil
	})
	return out
}

func keys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}

// queriesProblems checks every query against exp.
func queriesProblems(qs []dashQuery, exp exposition) []string {
	var out []string
	for _, q := range qs {
		for _, p := range exprProblems(q.expr, exp) {
			out = append(out, fmt.Sprintf("%s: %s", q.where, p))
		}
	}
	return out
}

// metricsOf are the metric names an expression reads.
func metricsOf(t *testing.T, expr string) []string {
	t.Helper()
	ast, err := promql.ParseExpr(expr)
	require.NoError(t, err, expr)
	var out []string
	parser.Inspect(ast, func(node parser.Node, _ []parser.Node) error {
		if vs, ok := node.(*parser.VectorSelector); ok && !slices.Contains(out, vs.Name) {
			out = append(out, vs.Name)
		}
		return nil
	})
	return out
}

// headingAnchor is GitHub's anchor of a Markdown heading.
func headingAnchor(h string) string {
	var b strings.Builder
	for _, r := range strings.ToLower(strings.TrimSpace(h)) {
		switch {
		case r == ' ':
			b.WriteRune('-')
		case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
			b.WriteRune(r)
		}
	}
	return b.String()
}

// linkProblems checks that every link, the dashboard's and its panels',
// points into the docs through the docs variable, to a document and
// heading that exist.
func linkProblems(d grafanaDashboard) []string {
	anchors := map[string]map[string]bool{}
	anchorsOf := func(doc string) (map[string]bool, error) {
		if a, ok := anchors[doc]; ok {
			return a, nil
		}
		b, err := os.ReadFile(path.Join(docsDir, doc))
		if err != nil {
			return nil, err
		}
		a := map[string]bool{}
		for _, line := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(line, "#") {
				a[headingAnchor(strings.TrimLeft(line, "#"))] = true
			}
		}
		anchors[doc] = a
		return a, nil
	}
	var out []string
	for _, p := range append(allPanels(d.Panels), grafanaPanel{Title: "(the dashboard's links)", Links: d.Links}) {
		for _, l := range p.Links {
			doc, ok := strings.CutPrefix(l.URL, "${docs}/")
			if !ok {
				out = append(out, fmt.Sprintf("panel %q: link %s does not start with ${docs}/", p.Title, l.URL))
				continue
			}
			doc, anchor, _ := strings.Cut(doc, "#")
			a, err := anchorsOf(doc)
			switch {
			case err != nil:
				out = append(out, fmt.Sprintf("panel %q: link %s: %v", p.Title, l.URL, err))
			case anchor != "" && !a[anchor]:
				out = append(out, fmt.Sprintf("panel %q: link %s: docs/%s has no heading #%s", p.Title, l.URL, doc, anchor))
			}
		}
	}
	return out
}

func loadDashboard(t *testing.T) (grafanaDashboard, []byte) {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	require.NoError(t, err)
	var d grafanaDashboard
	require.NoError(t, json.Unmarshal(raw, &d))
	return d, raw
}

// The checks fail where they should: each case is a dashboard or a query
// with one fault, and each fault is reported.
func TestDashboardChecksReportWhatIsWrong(t *testing.T) {
	t.Parallel()
	exp, err := parseExposition(strings.NewReader(`# TYPE tally_ingest_events_total counter
tally_ingest_events_total{result="accepted"} 3
# TYPE tally_outbox_oldest_pending_age_seconds gauge
tally_outbox_oldest_pending_age_seconds 12
# TYPE tally_outbox_items gauge
tally_outbox_items{state="pending"} 1
tally_outbox_items{state="uncertain"} 0
# TYPE tally_delivery_duration_seconds histogram
tally_delivery_duration_seconds_bucket{exporter="v1",le="0.1"} 1
tally_delivery_duration_seconds_bucket{exporter="v1",le="+Inf"} 2
tally_delivery_duration_seconds_sum{exporter="v1"} 0.3
tally_delivery_duration_seconds_count{exporter="v1"} 2
`))
	require.NoError(t, err)

	t.Run("queries", func(t *testing.T) {
		t.Parallel()
		for _, c := range []struct {
			expr, problem string
		}{
			{`sum(rate(tally_no_such_thing_total[5m]))`, "does not expose tally_no_such_thing_total"},
			{`sum(rate(tally_ingest_events_total[5m]`, "invalid PromQL"},
			{`sum by (result) (rate(tally_ingest_events_total[5m])) +`, "invalid PromQL"},
			{`tally_delivery_duration_seconds`, "does not expose tally_delivery_duration_seconds"},
			{`tally_ingest_events`, "does not expose tally_ingest_events"},
			{`tally_outbox_items{tenant="acme"}`, `carries no label "tenant"`},
			{`tally_outbox_items{state="uncertian"}`, `never shows state="uncertian"`},
			{`sum by (reason) (tally_outbox_items)`, `groups by "reason"`},
			{`max by (state) (tally_outbox_oldest_pending_age_seconds)`, `groups by "state"`},
			{`sum(tally_ingest_events_total)`, "is a counter"},
			{`sum(rate(tally_outbox_items[5m]))`, "is a gauge"},
			{`histogram_quantile(0.99, sum by (exporter) (rate(tally_delivery_duration_seconds_bucket[5m])))`, "drops le"},
			{`histogram_quantile(0.99, rate(tally_delivery_duration_seconds_sum[5m]))`, "not a _bucket series"},
			{`{state="pending"}`, "has no metric name"},
		} {
			require.Contains(t, strings.Join(exprProblems(c.expr, exp), "\n"), c.problem, c.expr)
		}
		// And the same checks pass what is right.
		for _, expr := range []string{
			`sum by (result, instance) (rate(tally_ingest_events_total{result="accepted", instance=~".+"}[1m]))`,
			`histogram_quantile(0.99, sum by (exporter, le) (rate(tally_delivery_duration_seconds_bucket[5m])))`,
			`rate(tally_delivery_duration_seconds_sum[5m]) / rate(tally_delivery_duration_seconds_count[5m])`,
			`max by (state) (tally_outbox_items{state=~"pending|leased"})`,
			`max by (kind) (label_replace(tally_outbox_items, "kind", "$1", "state", "(.+)"))`,
		} {
			require.Empty(t, exprProblems(expr, exp), expr)
		}
	})

	t.Run("dashboards", func(t *testing.T) {
		t.Parallel()
		ds := `"datasource":{"type":"prometheus","uid":"${datasource}"}`
		variable := `{"name":"datasource","type":"datasource","query":"prometheus"}`
		dash := func(vars, panels string) string {
			return `{"uid":"x","title":"x","schemaVersion":39,"annotations":{"list":[]},"templating":{"list":[` + vars + `]},"panels":[` + panels + `]}`
		}
		panel := func(id int, title, rest string) string {
			return fmt.Sprintf(`{"id":%d,"type":"timeseries","title":%q,"description":"d",%s}`, id, title, rest)
		}
		target := func(expr string) string {
			b, _ := json.Marshal(expr)
			return `"targets":[{"refId":"A","expr":` + string(b) + `}]`
		}
		good := panel(1, "a", ds+","+target("tally_outbox_items"))
		require.Empty(t, structureProblems([]byte(dash(variable, good))))
		for _, c := range []struct {
			json, problem string
		}{
			{dash(variable, good)[:40], "not a dashboard's JSON"},
			{dash("", good), `no template variable "datasource"`},
			{dash(variable, panel(1, "a", `"datasource":{"type":"prometheus","uid":"P1809F7CD0C75ACF3"},`+target("tally_outbox_items"))), "datasource must be"},
			{dash(variable, panel(1, "a", ds+`,"targets":[]`)), "has no target"},
			{dash(variable, panel(1, "", ds+","+target("tally_outbox_items"))), "has no title"},
			{dash(variable, good+","+panel(1, "b", ds+","+target("tally_outbox_items"))), `has the id of "a"`},
			{dash(variable, `{"id":2,"type":"row","title":"r","collapsed":true,"panels":[`+panel(2, "nested", ds+","+target("x"))+`]}`), `has the id of "r"`},
			{dash(variable, `{"id":2,"type":"row","title":"r","collapsed":true,"panels":[`+panel(3, "nested", ds+`,"targets":[]`)+`]}`), `"nested" has no target`},
			{strings.Replace(dash(variable, good), `"schemaVersion":39`, `"schemaVersion":16`, 1), "schemaVersion 16"},
			{strings.Replace(dash(variable, good), `"title":"a"`, `"title":"a","gridpos":{"h":8,"w":12,"x":0,"y":0}`, 1), "unexpected field 'gridpos'"},
			{strings.Replace(dash(variable, good), `"title":"a"`, `"title":"a","transparent":"yes"`, 1), "grafana schema: panels[0]"},
			{strings.Replace(dash(variable, good), `"annotations":{"list":[]},`, ``, 1), "annotations: required field is missing"},
		} {
			require.Contains(t, strings.Join(structureProblems([]byte(c.json)), "\n"), c.problem, c.json)
		}

		// Links must reach a heading of the docs through ${docs}.
		var linked grafanaDashboard
		require.NoError(t, json.Unmarshal([]byte(dash(variable, panel(1, "a", ds+","+target("x")+
			`,"links":[{"url":"${docs}/operations.md#tallyitemsuncertain"},{"url":"${docs}/operations.md#tallyitemsuncertian"},`+
			`{"url":"${docs}/nosuch.md"},{"url":"https://example.com/operations.md"}]`))), &linked))
		lp := strings.Join(linkProblems(linked), "\n")
		require.NotContains(t, lp, "#tallyitemsuncertain:")
		require.Contains(t, lp, "docs/operations.md has no heading #tallyitemsuncertian")
		require.Contains(t, lp, "nosuch.md: open")
		require.Contains(t, lp, "https://example.com/operations.md does not start with ${docs}/")

		// A nested panel's query is checked like any other, with the
		// variables substituted; an unknown variable is reported.
		var d grafanaDashboard
		require.NoError(t, json.Unmarshal([]byte(dash(variable+`,{"name":"instance","type":"query",`+ds+`,"query":{"query":"label_values(tally_outbox_items, instance)"}}`,
			`{"id":2,"type":"row","title":"r","collapsed":true,"panels":[`+
				panel(3, "nested", ds+","+target(`sum(rate(tally_missing_total{instance=~"$instance"}[$__rate_interval]))`))+","+
				panel(4, "typo", ds+","+target(`tally_outbox_items{instance=~"$instanse"}`))+`]}`)), &d))
		qs, problems := dashboardQueries(d)
		require.Len(t, qs, 2)
		require.Equal(t, `count by (instance) (tally_outbox_items)`, qs[0].expr)
		require.Equal(t, `sum(rate(tally_missing_total{instance=~".+"}[1m]))`, qs[1].expr)
		require.Contains(t, strings.Join(problems, "\n"), "unknown variable $instanse")
		require.Contains(t, strings.Join(queriesProblems(qs, exp), "\n"), `panel 3 "nested" target A: tally_missing_total{instance=~".+"}: the node does not expose tally_missing_total`)
	})
}

// The dashboard is a dashboard: well-formed, every panel titled and
// described with a target on the datasource variable, unique ids, links
// that reach a heading of the docs; and every alert of alerts.yml has a
// panel linking its section that reads every metric the alert reads.
func TestDashboardIsWellFormedAndCoversEveryAlert(t *testing.T) {
	t.Parallel()
	d, raw := loadDashboard(t)
	problems := append(structureProblems(raw), linkProblems(d)...)
	qs, qproblems := dashboardQueries(d)
	if problems = append(problems, qproblems...); len(problems) > 0 {
		t.Fatalf("%s:\n%s", dashboardFile, strings.Join(problems, "\n"))
	}
	for _, q := range qs {
		_, err := promql.ParseExpr(q.expr)
		require.NoError(t, err, q.where)
		require.NotContains(t, q.expr, "tenant", "%s: metrics carry no tenant", q.where)
	}

	b, err := os.ReadFile(alertsFile)
	require.NoError(t, err)
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert string `yaml:"alert"`
				Expr  string `yaml:"expr"`
			} `yaml:"rules"`
		} `yaml:"groups"`
	}
	require.NoError(t, yaml.Unmarshal(b, &rules))
	vars := variableValues(d)
	alerts := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			alerts++
			var read []string
			linked := false
			for _, p := range allPanels(d.Panels) {
				if !slices.ContainsFunc(p.Links, func(l grafanaLink) bool {
					return strings.HasSuffix(l.URL, "/operations.md#"+strings.ToLower(r.Alert))
				}) {
					continue
				}
				linked = true
				for _, tg := range p.Targets {
					expr, err := interpolate(tg.Expr, vars)
					require.NoError(t, err)
					read = append(read, metricsOf(t, expr)...)
				}
			}
			require.True(t, linked, "no panel links the section of %s", r.Alert)
			require.Subset(t, read, metricsOf(t, r.Expr), "the panels linking %s do not read every metric it reads", r.Alert)
		}
	}
	require.GreaterOrEqual(t, alerts, 15)
}

// dashboardNode is a node served by app.Serve on its own database, exporting
// to a Stripe simulator.
type dashboardNode struct {
	base, admin string
	logs        *syncbuf.Buffer
}

// startDashboardNode serves a node until the test ends: a key for the
// simulator's account, which has a count meter api_calls and a customer
// cus_dash.
func startDashboardNode(t *testing.T) *dashboardNode {
	t.Helper()
	sim := stripesim.New(stripesim.Options{})
	sim.CreateMeter(stripesim.DefaultAccount, stripesim.MeterSpec{EventName: "api_calls", Formula: "count"})
	sim.CreateCustomer(stripesim.DefaultAccount, "cus_dash")
	srv := httptest.NewServer(sim.Handler())
	t.Cleanup(srv.Close)

	secret := make([]byte, 24)
	_, _ = rand.Read(secret)
	n := &dashboardNode{admin: "dash-admin-" + hex.EncodeToString(secret), logs: &syncbuf.Buffer{}}
	env := map[string]string{"TALLY_DATABASE_URL": testdb.URL(t), "TALLY_LISTEN": "127.0.0.1:0", "TALLY_LOG_LEVEL": "warn",
		"TALLY_ADMIN_TOKEN": n.admin, "STRIPE_API_KEY": stripesim.DefaultKey, "STRIPE_API_BASE": srv.URL,
		"STRIPE_METER_EVENTS_BASE": srv.URL, "TALLY_STAGE_INTERVAL": "200ms", "TALLY_MAINTENANCE_INTERVAL": "500ms",
		"TALLY_POLL_INTERVAL": "100ms", "TALLY_SHUTDOWN_TIMEOUT": "5s"}
	fs := flag.NewFlagSet("dashboard", flag.ContinueOnError)
	load := config.Flags(fs, func(k string) string { return env[k] })
	require.NoError(t, fs.Parse(nil))
	cfg, err := load()
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	logger := slog.New(slog.NewTextHandler(n.logs, nil))
	db, err := app.Open(ctx, cfg, logger, false)
	require.NoError(t, err)
	parts, err := app.Build(cfg)
	require.NoError(t, err)
	addr := make(chan string, 1)
	served := make(chan error, 1)
	go func() { served <- app.Serve(ctx, cfg, db, parts, logger, func(a string) { addr <- a }) }()
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-served)
		db.Close()
		if t.Failed() {
			t.Logf("node log:\n%s", n.logs.String())
		}
	})
	select {
	case a := <-addr:
		n.base = "http://" + a
	case err := <-served:
		t.Fatalf("serve ended: %v", err)
	}
	return n
}

// call makes one API call as the admin and requires want.
func (n *dashboardNode) call(t *testing.T, method, route string, body any, want int) {
	t.Helper()
	b, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := http.NewRequest(method, n.base+route, bytes.NewReader(b))
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer "+n.admin)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	got, _ := io.ReadAll(resp.Body)
	require.Equal(t, want, resp.StatusCode, "%s %s: %s", method, route, got)
}

// scrape reads the node's /metrics in the text format.
func (n *dashboardNode) scrape(t *testing.T) exposition {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, n.base+"/metrics", nil)
	require.NoError(t, err)
	req.Header.Set("Accept", "text/plain;version=0.0.4")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	exp, err := parseExposition(resp.Body)
	require.NoError(t, err)
	return exp
}

// TestDashboardReadsWhatARunningNodeExposes serves a node, has it export
// one event to the simulator, and scrapes its /metrics until every query
// of the dashboard reads metrics, labels and label values the node shows
// (at most 20 seconds): a series a healthy node shows only after a while —
// an outbox transition, a heartbeat — gets that long to appear.
func TestDashboardReadsWhatARunningNodeExposes(t *testing.T) {
	t.Parallel()
	d, _ := loadDashboard(t)
	qs, problems := dashboardQueries(d)
	require.Empty(t, problems)
	require.NotEmpty(t, qs)

	n := startDashboardNode(t)
	n.call(t, http.MethodPut, "/v1/mappings/features/api_calls", map[string]any{"event_name": "api_calls", "aggregation": "count"}, http.StatusOK)
	n.call(t, http.MethodPut, "/v1/mappings/tenants/dash", map[string]any{"stripe_customer_id": "cus_dash"}, http.StatusOK)
	n.call(t, http.MethodPost, "/v1/usage", map[string]any{"events": []map[string]any{
		{"id": "dash-1", "tenant": "dash", "feature": "api_calls", "value": 1}}}, http.StatusAccepted)

	var exp exposition
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		exp = n.scrape(t)
		problems = queriesProblems(qs, exp)
		if len(problems) == 0 || time.Now().After(deadline) {
			break
		}
	}
	if len(problems) > 0 {
		t.Fatalf("the dashboard reads what a running node does not expose:\n%s", strings.Join(problems, "\n"))
	}
	// No series the node exposes carries a label Prometheus sets on every
	// scraped series: a default scrape would rename it exported_<name>,
	// and the dashboard and the alerts would read the scrape's value
	// instead (a heartbeat once had a label job).
	for name, s := range exp {
		for label := range s.values {
			require.False(t, targetLabels[label], "%s exposes a label %q, which Prometheus sets on every scraped series", name, label)
		}
	}
	// The checks are not vacuous against this exposition.
	require.NotEmpty(t, exprProblems(`sum(rate(tally_no_such_metric_total[5m]))`, exp))
	require.NotEmpty(t, exprProblems(`sum(rate(tally_ingest_events_total[5m])`, exp))
}
