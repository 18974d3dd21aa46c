package console

import (
	"fmt"
	"html/template"
	"math"
	"math/big"
	"strings"
	"time"

	"github.com/tallymeter/tally/quarantine"
)

// The charts are drawn on the server as inline SVG: no script, no CDN.

type point struct {
	At    time.Time
	Value float64
}

// palette gives each state a colour of the Okabe–Ito set, which readers
// with the common colour-vision deficiencies can tell apart; the charts
// add a pattern (fills) and the pages a glyph (stateCue), so that no state
// is told by colour alone.
var palette = map[string]string{
	"pending": "#0072b2", "leased": "#cc79a7", "quarantined": "#e69f00", "uncertain": "#d55e00",
	"accepted": "#56b4e9", "confirmed": "#009e73", "rejected": "#555555",
}

// patterns are the fills of the completeness chart's states, over their
// colours: confirmed solid, the others hatched each their own way.
var patterns = map[string]string{
	"confirmed":   "",
	"accepted":    `<path d="M0 6L6 0" stroke="#fff" stroke-width="1.5"/>`,
	"pending":     `<path d="M0 3H6" stroke="#fff" stroke-width="1.5"/>`,
	"quarantined": `<path d="M0 0L6 6M0 6L6 0" stroke="#fff" stroke-width="1"/>`,
	"uncertain":   `<circle cx="3" cy="3" r="1.2" fill="#fff"/>`,
	"rejected":    `<path d="M3 0V6" stroke="#fff" stroke-width="1.5"/>`,
}

// fill is a state's fill in the completeness chart.
func fill(state string) string {
	if patterns[state] == "" {
		return palette[state]
	}
	return "url(#fill-" + state + ")"
}

const (
	chartW, chartH = 900, 220
	padL, padB     = 56, 24
	padT, padR     = 12, 12
)

func escape(s string) string { return template.HTMLEscapeString(s) }

func niceMax(v float64) float64 {
	if v <= 0 {
		return 1
	}
	p := math.Pow(10, math.Floor(math.Log10(v)))
	for _, m := range []float64{1, 2, 5, 10} {
		if v <= m*p {
			return m * p
		}
	}
	return 10 * p
}

// frame draws the axes, the y grid and the time labels.
func frame(b *strings.Builder, from, to time.Time, maxY float64, unit string) {
	fmt.Fprintf(b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img" aria-label="%s">`,
		chartW, chartH, chartW, chartH, escape(unit))
	for i := 0; i <= 4; i++ {
		y := float64(padT) + float64(chartH-padT-padB)*float64(i)/4
		fmt.Fprintf(b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e5e7eb"/>`, padL, y, chartW-padR, y)
		fmt.Fprintf(b, `<text x="%d" y="%.1f" font-size="11" fill="#667085" text-anchor="end">%s</text>`,
			padL-6, y+4, escape(fmt.Sprintf("%g", maxY*float64(4-i)/4)))
	}
	span := to.Sub(from)
	for i := 0; i <= 6; i++ {
		t := from.Add(span * time.Duration(i) / 6)
		x := float64(padL) + float64(chartW-padL-padR)*float64(i)/6
		fmt.Fprintf(b, `<text x="%.1f" y="%d" font-size="11" fill="#667085" text-anchor="middle">%s</text>`,
			x, chartH-6, t.UTC().Format("15:04"))
	}
}

func xOf(t, from, to time.Time) float64 {
	f := float64(t.Sub(from)) / float64(to.Sub(from))
	return float64(padL) + f*float64(chartW-padL-padR)
}

func yOf(v, maxY float64) float64 {
	return float64(chartH-padB) - v/maxY*float64(chartH-padT-padB)
}

// lineChart draws one line per series, in the order given, with a legend.
func lineChart(series map[string][]point, order []string, from, to time.Time, unit string) template.HTML {
	maxV := 0.0
	for _, s := range series {
		for _, p := range s {
			maxV = math.Max(maxV, p.Value)
		}
	}
	maxY := niceMax(maxV)
	var b strings.Builder
	frame(&b, from, to, maxY, unit)
	for i, name := range order {
		pts := series[name]
		color := palette[name]
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="10" height="10" fill="%s"/><text x="%d" y="%d" font-size="11" fill="#1d2330">%s %s</text>`,
			padL+10+i*110, padT, color, padL+24+i*110, padT+9, stateCue[name], escape(name))
		if len(pts) == 0 {
			continue
		}
		var path strings.Builder
		for j, p := range pts {
			cmd := "L"
			if j == 0 {
				cmd = "M"
			}
			fmt.Fprintf(&path, "%s%.1f %.1f ", cmd, xOf(p.At, from, to), yOf(p.Value, maxY))
		}
		fmt.Fprintf(&b, `<path d="%s" fill="none" stroke="%s" stroke-width="2"/>`, strings.TrimSpace(path.String()), color)
		for _, p := range pts {
			fmt.Fprintf(&b, `<circle cx="%.1f" cy="%.1f" r="2.5" fill="%s"><title>%s %s: %g</title></circle>`,
				xOf(p.At, from, to), yOf(p.Value, maxY), color, escape(name), p.At.UTC().Format("15:04"), p.Value)
		}
	}
	if len(series) == 0 {
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="13" fill="#667085" text-anchor="middle">No snapshot yet: the maintenance pass writes one every five minutes.</text>`,
			chartW/2, chartH/2)
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String()) // built from numbers and escaped text only
}

// barChart draws one bar per hour.
func barChart(pts []point, from, to time.Time, unit string) template.HTML {
	maxV := 0.0
	for _, p := range pts {
		maxV = math.Max(maxV, p.Value)
	}
	maxY := niceMax(maxV)
	var b strings.Builder
	frame(&b, from, to, maxY, unit)
	w := float64(chartW-padL-padR) / 24 * 0.8
	for _, p := range pts {
		x := xOf(p.At, from, to)
		y := yOf(p.Value, maxY)
		fmt.Fprintf(&b, `<rect x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s"><title>%s: %g</title></rect>`,
			x, y, w, float64(chartH-padB)-y, palette["accepted"], p.At.UTC().Format("15:04"), p.Value)
	}
	if len(pts) == 0 {
		fmt.Fprintf(&b, `<text x="%d" y="%d" font-size="13" fill="#667085" text-anchor="middle">Nothing accepted in the last 24 hours.</text>`, chartW/2, chartH/2)
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}

// completenessChart draws, per line, a bar of the ingested value split by
// state (values may be negative corrections: the chart shows magnitudes
// of each bucket's share), each line labelled by labels[i].
func completenessChart(rep quarantine.Completeness, labels []string) template.HTML {
	if len(rep.Lines) == 0 {
		return ""
	}
	states := []string{"confirmed", "accepted", "pending", "quarantined", "uncertain", "rejected"}
	rowH, labelW, barW := 22, 300, 600
	h := len(rep.Lines)*rowH + 30
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" role="img" aria-label="completeness">`,
		labelW+barW+20, h, labelW+barW+20, h)
	b.WriteString(`<defs>`)
	for _, s := range states {
		if p := patterns[s]; p != "" {
			fmt.Fprintf(&b, `<pattern id="fill-%s" width="6" height="6" patternUnits="userSpaceOnUse"><rect width="6" height="6" fill="%s"/>%s</pattern>`,
				s, palette[s], p)
		}
	}
	b.WriteString(`</defs>`)
	for i, s := range states {
		fmt.Fprintf(&b, `<rect x="%d" y="2" width="12" height="12" fill="%s"/><text x="%d" y="13" font-size="11">%s %s</text>`,
			labelW+i*100, fill(s), labelW+16+i*100, stateCue[s], s)
	}
	for i, l := range rep.Lines {
		y := 24 + i*rowH
		label := l.Tenant + " · " + l.Feature + " · " + periodText(l.Period)
		if i < len(labels) {
			label = labels[i]
		}
		if r := []rune(label); len(r) > 48 {
			label = string(r[:47]) + "…"
		}
		fmt.Fprintf(&b, `<text x="0" y="%d" font-size="11">%s</text>`, y+12, escape(label))
		parts := []quarantine.Bucket{l.Confirmed, l.Accepted, l.Pending, l.Quarantined, l.Uncertain, l.Rejected}
		total := 0.0
		for _, p := range parts {
			total += float64(p.Events)
		}
		if total == 0 {
			continue
		}
		x := float64(labelW)
		for j, p := range parts {
			w := float64(barW) * float64(p.Events) / total
			if w <= 0 {
				continue
			}
			v, _ := new(big.Float).SetInt(big.NewInt(p.Events)).Float64()
			fmt.Fprintf(&b, `<rect x="%.1f" y="%d" width="%.1f" height="14" fill="%s"><title>%s %s: %g events, value %s</title></rect>`,
				x, y, w, fill(states[j]), stateCue[states[j]], states[j], v, escape(grouped(p.Value.String())))
			x += w
		}
	}
	b.WriteString(`</svg>`)
	return template.HTML(b.String())
}
