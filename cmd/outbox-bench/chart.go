package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"image/color"
	"io"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
)

func init() {
	register(benchCase{name: "chart", offline: true, usage: "render a results file's scale curves, drains and sustained runs as a PNG (no database)",
		flags: func(fs *flag.FlagSet) runner {
			o := chartOpts{in: "bench/results.jsonl", out: "bench/scale.png", width: 1400, height: 2250}
			fs.StringVar(&o.in, "in", o.in, "JSON lines written by the bench")
			fs.StringVar(&o.out, "out", o.out, "PNG to write")
			fs.IntVar(&o.width, "width", o.width, "image width in pixels")
			fs.IntVar(&o.height, "height", o.height, "image height in pixels")
			fs.StringVar(&o.note, "note", o.note, "a line under the title, e.g. how the run was sized")
			return func(context.Context, *Env, func(any) error) error { return renderChartFile(o) }
		}})
}

type chartOpts struct {
	in, out, note string
	width, height int
}

// chartRecord is what the chart reads of a line; other fields are ignored.
type chartRecord struct {
	Bench      string  `json:"bench"`
	LibVersion string  `json:"lib_version"`
	Commit     string  `json:"commit"`
	PG         string  `json:"pg"`
	Durable    bool    `json:"durable"`
	Curve      string  `json:"curve"`
	X          float64 `json:"x"`
	Y          float64 `json:"y"`
	YName      string  `json:"y_name"`
	Backlog    string  `json:"backlog"`
	PerTx      int     `json:"prewrite_per_tx"`
	Events     float64 `json:"events"`
	EventsPerS float64 `json:"events_per_s"`
	Consumers  float64 `json:"consumers"`
	Ratio      float64 `json:"ratio"`
	LagP99MS   float64 `json:"lag_p99_ms"`
	// ClientStatementsPerS is what the idle consumers' pools sent, by the driver's count.
	ClientStatementsPerS float64 `json:"client_statements_per_s"`
	ServerCPUMSPerS      float64 `json:"server_cpu_ms_per_s"`
	// The sustained runs' server CPU per delete transaction, with the module and without it.
	ServerCPUPerTx         float64 `json:"server_cpu_us_per_tx"`
	BaselineServerCPUPerTx float64 `json:"baseline_server_cpu_us_per_tx"`
	// The standby case: where its consumers read, the rate asked, and the standby's replay lag.
	ReadFrom       string  `json:"read_from"`
	Rate           float64 `json:"rate"`
	AchievedRate   float64 `json:"achieved_rate"`
	ReplayLagP99MS float64 `json:"replay_lag_p99_ms"`
	// OneProcess: the consumers shared one pool (-one-process), a curve of its own.
	OneProcess bool `json:"one_process"`
}

func readRecords(r io.Reader) ([]chartRecord, error) {
	var out []chartRecord
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 64*1024), 16*1024*1024)
	for n := 1; sc.Scan(); n++ {
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var rec chartRecord
		if err := json.Unmarshal(b, &rec); err != nil {
			return nil, fmt.Errorf("line %d: %w", n, err)
		}
		out = append(out, rec)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read results: %w", err)
	}
	return out, nil
}

func renderChartFile(o chartOpts) error {
	f, err := os.Open(o.in)
	if err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	recs, err := readRecords(f)
	f.Close()
	if err != nil {
		return fmt.Errorf("chart: %s: %w", o.in, err)
	}
	out, err := os.Create(o.out)
	if err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	if err := renderChart(out, recs, o); err != nil {
		out.Close()
		return fmt.Errorf("chart: %w", err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	return nil
}

// series is one named set of points of a panel, with optional per-point labels.
type series struct {
	name   string
	pts    plotter.XYs
	labels []string
}

type panel struct {
	title, xLabel, yLabel string
	series                []*series
	// drawn is what plot drew, one entry per legend line, for the tests.
	drawn []drawnSeries
}

// drawnSeries is how one series was drawn: its style index and whether a line joins its points.
type drawnSeries struct {
	name      string
	style     int
	connected bool
}

// add adds a point to the named series; a second point at the same x is dropped (the all case
// prints each drain twice, as a drain line and as a scale point).
func (p *panel) add(name string, x, y float64, label string) {
	for _, s := range p.series {
		if s.name == name {
			for _, pt := range s.pts {
				if pt.X == x {
					return
				}
			}
			s.pts = append(s.pts, plotter.XY{X: x, Y: y})
			s.labels = append(s.labels, label)
			return
		}
	}
	p.series = append(p.series, &series{name: name, pts: plotter.XYs{{X: x, Y: y}}, labels: []string{label}})
}

// renderChart draws ten panels: the two idle curves (statements and CPU), drain rate against
// backlog size (the scale curve's points and the drain lines, one series per backlog kind),
// the sustained runs against the consumer count: throughput ratio (each point labelled with its
// p99 lag), the module's server CPU per delete, and the p99 lag; and the standby case against
// the consumer count: the primary's server CPU per delete with the consumers reading from the
// primary and from a standby, beside the run without consumers, and their p99 delivery lag with
// the standby's replay lag.
func renderChart(w io.Writer, recs []chartRecord, o chartOpts) error {
	if o.width < 200 || o.height < 200 {
		return errors.New("the image needs at least 200x200 pixels")
	}
	// Statements per second and CPU milliseconds per second are different units: each gets its
	// own panel, the consumer curve on the left and the project curve on the right.
	idleKS := &panel{title: "Idle: K consumers of one project", xLabel: "consumers", yLabel: "statements per second"}
	idlePS := &panel{title: "Idle: one consumer of P projects", xLabel: "projects", yLabel: "statements per second"}
	idleKC := &panel{title: "Idle: K consumers of one project", xLabel: "consumers", yLabel: "server CPU ms per second"}
	idlePC := &panel{title: "Idle: one consumer of P projects", xLabel: "projects", yLabel: "server CPU ms per second"}
	drain := &panel{title: "Drain: one fresh consumer", xLabel: "backlog (events)", yLabel: "events/s"}
	sust := &panel{title: "Sustained: writers at full speed, outbox vs baseline", xLabel: "consumers", yLabel: "tx/s with outbox ÷ without"}
	sustCPU := &panel{title: "Sustained: the module's server CPU per delete", xLabel: "consumers",
		yLabel: "µs per delete (with outbox − baseline)"}
	sustLag := &panel{title: "Sustained: delivery lag", xLabel: "consumers", yLabel: "p99 lag (ms)"}
	sbCPU, sbLag := standbyPanels(recs)
	var first *chartRecord
	commits := map[string]bool{}
	var commitOrder []string
	n := 0
	for i := range recs {
		r := &recs[i]
		switch {
		case r.Bench == "scale" && (r.Curve == curveIdleConsumers || r.Curve == curveIdleProjects):
			ps, pc := idleKS, idleKC
			if r.Curve == curveIdleProjects {
				ps, pc = idlePS, idlePC
			}
			ps.add(measureName(r.YName), r.X, r.Y, "")
			ps.add("statements/s sent (driver count)", r.X, r.ClientStatementsPerS, "")
			pc.add("server CPU ms/s", r.X, r.ServerCPUMSPerS, "")
		case r.Bench == "scale" && r.Curve == curveDrainBacklog:
			drain.add(drainSeriesName(r.Backlog, r.PerTx), r.X, r.Y, "")
		case r.Bench == "drain":
			drain.add(drainSeriesName(r.Backlog, r.PerTx), r.Events, r.EventsPerS, "")
		case r.Bench == "sustained":
			sust.add("tx/s with outbox ÷ without, labelled with the p99 lag", r.Consumers, r.Ratio, fmt.Sprintf("p99 lag %s ms", strconv.FormatFloat(r.LagP99MS, 'f', 0, 64)))
			sustCPU.add("server CPU µs per delete, with outbox − without", r.Consumers, r.ServerCPUPerTx-r.BaselineServerCPUPerTx, "")
			sustLag.add("p99 commit-to-delivery lag", r.Consumers, r.LagP99MS, "")
		case r.Bench == "standby":
		default:
			continue
		}
		n++
		if first == nil {
			first = r
		}
		if c := commitOf(r); !commits[c] {
			commits[c] = true
			commitOrder = append(commitOrder, c)
		}
	}
	if n == 0 {
		return errors.New("no scale, drain, sustained or standby lines to draw")
	}
	// A row none of whose panels has data is left out: a file of one case's lines (the standby
	// case's, say) is drawn on its own rows.
	var panels [][]*panel
	for _, row := range [][]*panel{{idleKS, idlePS}, {idleKC, idlePC}, {drain, sust}, {sustCPU, sustLag}, {sbCPU, sbLag}} {
		if len(row[0].series) > 0 || len(row[1].series) > 0 {
			panels = append(panels, row)
		}
	}
	plots := make([][]*plot.Plot, len(panels))
	for j, row := range panels {
		for _, pn := range row {
			p, err := pn.plot()
			if err != nil {
				return err
			}
			plots[j] = append(plots[j], p)
		}
	}

	const dpi = 96
	c := vgimg.NewWith(vgimg.UseWH(vg.Length(o.width)/dpi*vg.Inch, vg.Length(o.height)/dpi*vg.Inch), vgimg.UseDPI(dpi))
	dc := draw.New(c)
	title := plot.New().Title.TextStyle
	title.Font.Size = vg.Points(14)
	small := title
	small.Font.Size = vg.Points(10)
	top := dc.Max.Y - vg.Points(6)
	head := fmt.Sprintf("outbox-bench, %s, PostgreSQL %s, durable %t", strings.Join(commitOrder, " + "), first.PG, first.Durable)
	dc.FillText(title, vg.Point{X: dc.Center().X, Y: top}, head)
	reserved := title.Rectangle(head).Size().Y + vg.Points(12)
	if o.note != "" {
		dc.FillText(small, vg.Point{X: dc.Center().X, Y: top - reserved + vg.Points(4)}, o.note)
		reserved += small.Rectangle(o.note).Size().Y + vg.Points(4)
	}
	body := draw.Crop(dc, 0, 0, 0, -reserved)
	tiles := draw.Tiles{Rows: len(plots), Cols: len(plots[0]), PadX: vg.Points(24), PadY: vg.Points(24),
		PadTop: vg.Points(6), PadBottom: vg.Points(6), PadLeft: vg.Points(6), PadRight: vg.Points(12)}
	canvases := plot.Align(plots, tiles, body)
	for j := range plots {
		for i := range plots[j] {
			plots[j][i].Draw(canvases[j][i])
		}
	}
	if _, err := (vgimg.PngCanvas{Canvas: c}).WriteTo(w); err != nil {
		return fmt.Errorf("write png: %w", err)
	}
	return nil
}

// standbyPanels draws the standby case's lines: the primary's server CPU per delete against K
// with the consumers reading from the primary and from a standby, and the run without
// consumers (the hook and the ticker) drawn flat across the Ks measured, its reference; and
// the p99 delivery lag of both against K beside the standby's p99 replay lag. A second round's
// point at the same K is not drawn (panel.add keeps the first). A point whose writers fell short
// of the rate asked is labelled with the rate they reached.
func standbyPanels(recs []chartRecord) (cpu, lag *panel) {
	cpu = &panel{title: "Standby reads: the primary's server CPU per delete at a steady rate", xLabel: "consumers",
		yLabel: "µs of primary CPU per delete"}
	lag = &panel{title: "Standby reads: delivery lag at a steady rate", xLabel: "consumers", yLabel: "p99 (ms)"}
	var none []*chartRecord
	for i := range recs {
		r := &recs[i]
		switch {
		case r.Bench != "standby":
		case r.ReadFrom == "none":
			none = append(none, r)
		default:
			from := "K consumers reading from the primary"
			if r.ReadFrom == "standby" {
				from = "K consumers reading from a standby"
				lag.add("p99 standby replay lag (standby runs)", r.Consumers, r.ReplayLagP99MS, "")
			}
			if r.OneProcess {
				from += ", one process"
			}
			label := ""
			if r.AchievedRate > 0 && r.AchievedRate < 0.95*r.Rate {
				label = fmt.Sprintf("%.0f/s reached", r.AchievedRate)
			}
			cpu.add(fmt.Sprintf("%s, %s deletes/s asked", from, humanCount(r.Rate)), r.Consumers, r.ServerCPUPerTx, label)
			lag.add("p99 commit-to-delivery lag, "+strings.TrimPrefix(from, "K "), r.Consumers, r.LagP99MS, "")
		}
	}
	var ks []float64
	for _, s := range cpu.series {
		for _, pt := range s.pts {
			ks = append(ks, pt.X)
		}
	}
	for _, r := range none {
		for _, k := range ks {
			cpu.add(fmt.Sprintf("hook and ticker, no consumer, %s deletes/s asked (drawn at each K)", humanCount(r.Rate)), k, r.ServerCPUPerTx, "")
		}
	}
	return cpu, lag
}

func measureName(yName string) string {
	switch yName {
	case "statements_per_s":
		return "statements/s executed (pg_stat_statements)"
	case "xacts_per_s":
		return "transactions/s (pg_stat_database)"
	}
	return yName
}

// drainSeriesName keeps apart drains whose backlogs were written differently: a backlog
// written 50 deletes to a transaction is not a point on the curve of one delete per
// transaction.
func drainSeriesName(backlog string, perTx int) string {
	switch {
	case perTx == 1:
		return backlog + " backlog, 1 delete per transaction"
	case perTx > 1:
		return fmt.Sprintf("%s backlog, %d deletes per transaction", backlog, perTx)
	}
	return backlog + " backlog"
}

// commitOf says which commit a line was measured at: the commit field when the bench
// recorded one, else the revision in lib_version ("(devel)+<rev>" or a pseudo-version), else
// "commit unknown" (a "go run" build carries no VCS stamp, so older lines say only
// "(devel)+schema.N").
func commitOf(r *chartRecord) string {
	if r.Commit != "" {
		return "commit " + shortRev(r.Commit)
	}
	v := r.LibVersion
	if rest, ok := strings.CutPrefix(v, "(devel)+"); ok {
		if strings.HasPrefix(rest, "schema.") {
			return "commit unknown (" + strings.Replace(rest, ".", " ", 1) + ")"
		}
		return "commit " + rest
	}
	if v == "" || v == "(devel)" {
		return "commit unknown"
	}
	return v
}

func shortRev(rev string) string {
	base, dirty := strings.CutSuffix(rev, "-dirty")
	if len(base) > 12 {
		base = base[:12]
	}
	if dirty {
		base += "-dirty"
	}
	return base
}

// okabeIto is the Okabe-Ito palette, told apart by readers with any common colour-vision
// deficiency; each style also has its own marker and dash pattern, so no series depends on
// colour alone.
var okabeIto = []color.NRGBA{
	{0x00, 0x72, 0xB2, 0xff}, // blue
	{0xE6, 0x9F, 0x00, 0xff}, // orange
	{0x00, 0x9E, 0x73, 0xff}, // bluish green
	{0xCC, 0x79, 0xA7, 0xff}, // reddish purple
	{0xD5, 0x5E, 0x00, 0xff}, // vermillion
	{0x56, 0xB4, 0xE9, 0xff}, // sky blue
	{0x00, 0x00, 0x00, 0xff}, // black
}

var markers = []draw.GlyphDrawer{draw.CircleGlyph{}, draw.PyramidGlyph{}, draw.SquareGlyph{},
	draw.CrossGlyph{}, draw.PlusGlyph{}, draw.RingGlyph{}, draw.TriangleGlyph{}}

var dashes = [][]vg.Length{nil, {vg.Points(6), vg.Points(3)}, {vg.Points(2), vg.Points(2)},
	{vg.Points(8), vg.Points(3), vg.Points(2), vg.Points(3)}}

// minConnected is the fewest points a series needs before a line joins them: a line through
// two points reads as a trend the data does not show.
const minConnected = 3

// mergeIdentical folds a series whose points equal an earlier one's into that one, naming both
// in the legend: drawn separately, the later would cover the earlier exactly and show only in
// the legend.
func (pn *panel) mergeIdentical() {
	var kept []*series
	for _, s := range pn.series {
		var same *series
		for _, k := range kept {
			if samePoints(k.pts, s.pts) {
				same = k
				break
			}
		}
		if same == nil {
			kept = append(kept, s)
			continue
		}
		same.name += " = " + s.name
		for i := range same.labels {
			if same.labels[i] == "" {
				same.labels[i] = s.labels[i]
			}
		}
	}
	pn.series = kept
}

func samePoints(a, b plotter.XYs) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// plot builds the panel: a log x axis with ticks at the measured values, a linear y axis from
// 0, one style per series (a line with markers from minConnected points, markers alone below),
// and the points' labels where they have any.
func (pn *panel) plot() (*plot.Plot, error) {
	p := plot.New()
	p.Title.Text, p.X.Label.Text, p.Y.Label.Text = pn.title, pn.xLabel, pn.yLabel
	if len(pn.series) == 0 {
		p.Title.Text += " (no data)"
		return p, nil
	}
	for _, s := range pn.series {
		sort.Sort(byX{s})
	}
	pn.mergeIdentical()
	pn.drawn = nil
	var xs []float64
	minX, maxX, maxY := math.Inf(1), math.Inf(-1), 0.0
	for i, s := range pn.series {
		for _, pt := range s.pts {
			xs = append(xs, pt.X)
			minX, maxX, maxY = math.Min(minX, pt.X), math.Max(maxX, pt.X), math.Max(maxY, pt.Y)
		}
		points, err := plotter.NewScatter(s.pts)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", pn.title, err)
		}
		points.Color, points.Shape, points.Radius = okabeIto[i%len(okabeIto)], markers[i%len(markers)], vg.Points(4)
		connected := len(s.pts) >= minConnected
		if connected {
			line, err := plotter.NewLine(s.pts)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", pn.title, err)
			}
			line.Color, line.Width, line.Dashes = okabeIto[i%len(okabeIto)], vg.Points(1.5), dashes[i%len(dashes)]
			p.Add(line, points)
			p.Legend.Add(s.name, line, points)
		} else {
			p.Add(points)
			p.Legend.Add(s.name, points)
		}
		pn.drawn = append(pn.drawn, drawnSeries{name: s.name, style: i, connected: connected})
		if hasLabels(s.labels) {
			l, err := plotter.NewLabels(plotter.XYLabels{XYs: s.pts, Labels: s.labels})
			if err != nil {
				return nil, fmt.Errorf("%s: %w", pn.title, err)
			}
			for k := range l.TextStyle {
				l.TextStyle[k].Font.Size = vg.Points(9)
			}
			l.Offset = vg.Point{X: vg.Points(6), Y: vg.Points(4)}
			p.Add(l)
		}
	}
	p.Legend.Top = true
	p.Legend.Left = true
	p.Legend.XOffs, p.Legend.YOffs = vg.Points(8), -vg.Points(6)
	if minX > 0 {
		p.X.Scale = plot.LogScale{}
		p.X.Min, p.X.Max = minX/1.6, maxX*1.6
	} else {
		p.X.Min, p.X.Max = minX-1, maxX+1
	}
	p.X.Tick.Marker = valueTicks(xs)
	// Headroom above the highest point keeps the legend clear of the data.
	p.Y.Min, p.Y.Max = 0, math.Max(maxY*(1.2+0.1*float64(len(pn.series))), 1)
	p.Y.Tick.Marker = humanTicks{}
	p.Add(plotter.NewGrid())
	return p, nil
}

type byX struct{ s *series }

func (b byX) Len() int           { return len(b.s.pts) }
func (b byX) Less(i, j int) bool { return b.s.pts[i].X < b.s.pts[j].X }
func (b byX) Swap(i, j int) {
	b.s.pts[i], b.s.pts[j] = b.s.pts[j], b.s.pts[i]
	b.s.labels[i], b.s.labels[j] = b.s.labels[j], b.s.labels[i]
}

func hasLabels(ls []string) bool {
	for _, l := range ls {
		if l != "" {
			return true
		}
	}
	return false
}

// valueTicks marks the measured x values, labelled 1, 64, 10k, 1M.
type valueTicks []float64

func (v valueTicks) Ticks(lo, hi float64) []plot.Tick {
	seen := map[float64]bool{}
	var out []plot.Tick
	for _, x := range v {
		if x >= lo && x <= hi && !seen[x] {
			seen[x] = true
			out = append(out, plot.Tick{Value: x, Label: humanCount(x)})
		}
	}
	return out
}

// humanTicks are the default ticks with labels such as 0, 0.5 and 250k.
type humanTicks struct{}

func (humanTicks) Ticks(lo, hi float64) []plot.Tick {
	ticks := plot.DefaultTicks{}.Ticks(lo, hi)
	for i := range ticks {
		if ticks[i].Label != "" {
			ticks[i].Label = humanCount(ticks[i].Value)
		}
	}
	return ticks
}

func humanCount(x float64) string {
	switch {
	case x >= 1e6 && math.Mod(x, 1e5) == 0:
		return strconv.FormatFloat(x/1e6, 'f', -1, 64) + "M"
	case x >= 1e3 && math.Mod(x, 100) == 0:
		return strconv.FormatFloat(x/1e3, 'f', -1, 64) + "k"
	default:
		return strconv.FormatFloat(x, 'f', -1, 64)
	}
}
