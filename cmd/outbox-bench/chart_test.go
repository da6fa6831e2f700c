package main

import (
	"bytes"
	"image/png"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// chartLines are a few lines as the bench prints them (shortened to what the chart reads).
const chartLines = `
{"bench":"scale","lib_version":"(devel)+test","pg":"15","durable":true,"curve":"idle_statements_vs_consumers","x":1,"y":2,"y_name":"statements_per_s"}
{"bench":"scale","lib_version":"(devel)+test","pg":"15","durable":true,"curve":"idle_statements_vs_consumers","x":4,"y":8,"y_name":"statements_per_s"}
{"bench":"scale","curve":"idle_statements_vs_projects","x":1,"y":2,"y_name":"statements_per_s"}
{"bench":"scale","curve":"idle_statements_vs_projects","x":10000,"y":3.5,"y_name":"statements_per_s"}
{"bench":"scale","curve":"drain_vs_backlog","x":10000,"y":26000,"y_name":"events_per_s","backlog":"unsequenced","prewrite_per_tx":1}
{"bench":"scale","curve":"drain_vs_backlog","x":1000000,"y":41000,"y_name":"events_per_s","backlog":"unsequenced","prewrite_per_tx":50}
{"bench":"drain","events":200000,"events_per_s":400000,"backlog":"sequenced","prewrite_per_tx":0}
{"bench":"drain","events":10000,"events_per_s":26000,"backlog":"unsequenced","prewrite_per_tx":1}
{"bench":"sustained","consumers":2,"ratio":0.8,"lag_p99_ms":12}
{"bench":"sustained","consumers":8,"ratio":0.6,"lag_p99_ms":40}
{"bench":"standby","consumers":0,"read_from":"none","rate":1000,"server_cpu_us_per_tx":400}
{"bench":"standby","consumers":1,"read_from":"primary","rate":1000,"server_cpu_us_per_tx":600,"lag_p99_ms":20}
{"bench":"standby","consumers":1,"read_from":"standby","rate":1000,"server_cpu_us_per_tx":450,"lag_p99_ms":25,"replay_lag_p99_ms":3}
{"bench":"standby","consumers":16,"read_from":"primary","rate":1000,"achieved_rate":400,"server_cpu_us_per_tx":2000,"lag_p99_ms":90}
{"bench":"standby","consumers":16,"read_from":"standby","rate":1000,"server_cpu_us_per_tx":700,"lag_p99_ms":80,"replay_lag_p99_ms":5}
{"bench":"write","baseline":{"tx":1}}
`

func TestChartRendersPNG(t *testing.T) {
	dir := t.TempDir()
	in, out := filepath.Join(dir, "results.jsonl"), filepath.Join(dir, "scale.png")
	require.NoError(t, os.WriteFile(in, []byte(chartLines), 0o644))
	require.NoError(t, renderChartFile(chartOpts{in: in, out: out, width: 900, height: 700, note: "test lines"}))

	b, err := os.ReadFile(out)
	require.NoError(t, err)
	img, err := png.Decode(bytes.NewReader(b))
	require.NoError(t, err)
	require.Equal(t, 900, img.Bounds().Dx())
	require.Equal(t, 700, img.Bounds().Dy())
	// Something was drawn: not every pixel is the white background.
	r0, g0, b0, _ := img.At(0, 0).RGBA()
	drawn := false
	for y := 0; y < 700 && !drawn; y += 3 {
		for x := 0; x < 900 && !drawn; x += 3 {
			r, g, b, _ := img.At(x, y).RGBA()
			drawn = r != r0 || g != g0 || b != b0
		}
	}
	require.True(t, drawn, "the chart is blank")
}

func TestChartRefusesNothingToDraw(t *testing.T) {
	var buf bytes.Buffer
	recs, err := readRecords(strings.NewReader(`{"bench":"write"}` + "\n"))
	require.NoError(t, err)
	require.ErrorContains(t, renderChart(&buf, recs, chartOpts{width: 400, height: 300}), "no scale, drain, sustained or standby lines")
	_, err = readRecords(strings.NewReader("{\"bench\":\"scale\"}\nnot json\n"))
	require.ErrorContains(t, err, "line 2")
}

// TestChartStandbyPanels: the standby case's runs are two curves of the primary's CPU per
// delete against K, with the run without consumers drawn flat at each K beside them, and the
// lag panel has the standby's replay lag beside both delivery lags.
func TestChartStandbyPanels(t *testing.T) {
	recs, err := readRecords(strings.NewReader(chartLines))
	require.NoError(t, err)
	cpu, lag := standbyPanels(recs)
	byName := func(p *panel) map[string][][2]float64 {
		out := map[string][][2]float64{}
		for _, s := range p.series {
			for _, pt := range s.pts {
				out[s.name] = append(out[s.name], [2]float64{pt.X, pt.Y})
			}
		}
		return out
	}
	require.Equal(t, map[string][][2]float64{
		"K consumers reading from the primary, 1k deletes/s asked":           {{1, 600}, {16, 2000}},
		"K consumers reading from a standby, 1k deletes/s asked":             {{1, 450}, {16, 700}},
		"hook and ticker, no consumer, 1k deletes/s asked (drawn at each K)": {{1, 400}, {16, 400}},
	}, byName(cpu))
	for _, s := range cpu.series {
		if strings.Contains(s.name, "from the primary") {
			require.Equal(t, []string{"", "400/s reached"}, s.labels, "the point whose writers fell short says so")
		}
	}
	require.Equal(t, map[string][][2]float64{
		"p99 commit-to-delivery lag, consumers reading from the primary": {{1, 20}, {16, 90}},
		"p99 commit-to-delivery lag, consumers reading from a standby":   {{1, 25}, {16, 80}},
		"p99 standby replay lag (standby runs)":                          {{1, 3}, {16, 5}},
	}, byName(lag))

	// Consumers of one process are curves of their own beside those with a pool each.
	one, err := readRecords(strings.NewReader(`{"bench":"standby","consumers":16,"read_from":"standby","rate":1000,"achieved_rate":1000,"server_cpu_us_per_tx":900,"lag_p99_ms":70,"one_process":true}
{"bench":"standby","consumers":16,"read_from":"standby","rate":1000,"achieved_rate":1000,"server_cpu_us_per_tx":950,"lag_p99_ms":75}`))
	require.NoError(t, err)
	cpu, lag = standbyPanels(one)
	require.Equal(t, map[string][][2]float64{
		"K consumers reading from a standby, one process, 1k deletes/s asked": {{16, 900}},
		"K consumers reading from a standby, 1k deletes/s asked":              {{16, 950}},
	}, byName(cpu))
	require.Contains(t, byName(lag), "p99 commit-to-delivery lag, consumers reading from a standby, one process")
}

// TestChartDrawsOnlyRowsWithData: a file of the standby case's lines alone is drawn on its one
// row, legibly at a small height.
func TestChartDrawsOnlyRowsWithData(t *testing.T) {
	var only []string
	for _, l := range strings.Split(chartLines, "\n") {
		if strings.Contains(l, `"bench":"standby"`) {
			only = append(only, l)
		}
	}
	recs, err := readRecords(strings.NewReader(strings.Join(only, "\n")))
	require.NoError(t, err)
	require.Len(t, recs, 5)
	var buf bytes.Buffer
	require.NoError(t, renderChart(&buf, recs, chartOpts{width: 900, height: 400}))
	cfg, err := png.DecodeConfig(&buf)
	require.NoError(t, err)
	require.Equal(t, [2]int{900, 400}, [2]int{cfg.Width, cfg.Height})
}

func TestChartPanelDropsRepeatedX(t *testing.T) {
	p := &panel{}
	p.add("a", 10, 1, "")
	p.add("a", 10, 2, "")
	p.add("a", 20, 3, "x")
	p.add("b", 10, 4, "")
	require.Len(t, p.series, 2)
	require.Len(t, p.series[0].pts, 2)
	require.Equal(t, 1.0, p.series[0].pts[0].Y, "the first point at an x is kept")
	require.Equal(t, []string{"", "x"}, p.series[0].labels)
}

// TestChartCommandLine runs chart as a user does: it starts no database and prints no line.
func TestChartCommandLine(t *testing.T) {
	dir := t.TempDir()
	in, out := filepath.Join(dir, "results.jsonl"), filepath.Join(dir, "chart.png")
	require.NoError(t, os.WriteFile(in, []byte(chartLines), 0o644))
	var stdout bytes.Buffer
	require.NoError(t, run([]string{"chart", "-in", in, "-out", out, "-width", "640", "-height", "480"}, &stdout, io.Discard))
	require.Empty(t, stdout.String())
	f, err := os.Open(out)
	require.NoError(t, err)
	defer f.Close()
	cfg, err := png.DecodeConfig(f)
	require.NoError(t, err)
	require.Equal(t, [2]int{640, 480}, [2]int{cfg.Width, cfg.Height})
}

// TestChartIdenticalSeriesAreNamedTogether: the idle runs' statements executed and statements
// sent are the same numbers; drawn as two series the second covers the first, which shows only
// in the legend. They are drawn once, named together, and every drawn series has its own style.
func TestChartIdenticalSeriesAreNamedTogether(t *testing.T) {
	p := &panel{title: "t"}
	for _, x := range []float64{1, 4, 16} {
		p.add("executed", x, 2*x, "")
		p.add("sent", x, 2*x, "")
		p.add("cpu", x, 3*x, "")
	}
	_, err := p.plot()
	require.NoError(t, err)
	require.Len(t, p.drawn, 2, "identical series are drawn once")
	require.Equal(t, "executed = sent", p.drawn[0].name)
	require.Equal(t, "cpu", p.drawn[1].name)
	styles := map[int]bool{}
	for _, d := range p.drawn {
		require.False(t, styles[d.style], "two series share style %d", d.style)
		styles[d.style] = true
	}
}

// TestChartShortSeriesAreUnconnected: a line through two points draws a trend the data does
// not show; such series are markers only.
func TestChartShortSeriesAreUnconnected(t *testing.T) {
	p := &panel{title: "t"}
	p.add("two", 2, 0.5, "p99 lag 74 ms")
	p.add("two", 8, 0.3, "p99 lag 107 ms")
	p.add("one", 1e6, 9e4, "")
	for _, x := range []float64{1e4, 1e5, 2e5} {
		p.add("three", x, x, "")
	}
	_, err := p.plot()
	require.NoError(t, err)
	connected := map[string]bool{}
	for _, d := range p.drawn {
		connected[d.name] = d.connected
	}
	require.Equal(t, map[string]bool{"two": false, "one": false, "three": true}, connected)
}

// TestChartDrainsWrittenDifferentlyAreSeparate: the 1M drain's backlog was written 50 deletes
// to a transaction, the others one; one line through all of them compares unlike things.
func TestChartDrainsWrittenDifferentlyAreSeparate(t *testing.T) {
	one, fifty := drainSeriesName("unsequenced", 1), drainSeriesName("unsequenced", 50)
	require.NotEqual(t, one, fifty)
	require.Contains(t, fifty, "50 deletes per transaction")
	require.Equal(t, "sequenced backlog", drainSeriesName("sequenced", 0))
}

// TestChartNamesTheCommit: "(devel)" is where the commit belongs; the chart shows the commit the
// bench recorded, the revision in lib_version, or says it is unknown.
func TestChartNamesTheCommit(t *testing.T) {
	for _, c := range []struct {
		rec  chartRecord
		want string
	}{
		{chartRecord{LibVersion: "(devel)+schema.16"}, "commit unknown (schema 16)"},
		{chartRecord{LibVersion: "(devel)"}, "commit unknown"},
		{chartRecord{LibVersion: "(devel)+4b2fc96a1b2c-dirty"}, "commit 4b2fc96a1b2c-dirty"},
		{chartRecord{LibVersion: "v0.0.0-20261202092917-50869dd0b4fb", Commit: "50869dd0b4fbcdfd5a54e37355c553407d9db4dd"}, "commit 50869dd0b4fb"},
		{chartRecord{LibVersion: "(devel)+schema.16", Commit: "50869dd0b4fbcdfd5a54e37355c553407d9db4dd-dirty"}, "commit 50869dd0b4fb-dirty"},
		{chartRecord{LibVersion: "v1.2.0"}, "v1.2.0"},
	} {
		require.Equal(t, c.want, commitOf(&c.rec), "%+v", c.rec)
	}
}
