package web

import (
	"strings"
	"testing"
)

func TestStreamIDRoundTrip(t *testing.T) {
	projects := []string{"alpha", "beta", "gamma"}
	fp := streamFingerprint(projects)
	id := string(appendStreamID(nil, fp, []int64{0, 35, 1 << 40}))
	if id != "1."+fp+".0.z.e13wu1og" {
		t.Fatalf("id %q", id)
	}
	got, err := parseStreamID(id, fp, 3)
	if err != nil || got[0] != 0 || got[1] != 35 || got[2] != 1<<40 {
		t.Fatalf("parse %q: %v %v", id, got, err)
	}
	if streamFingerprint([]string{"alpha", "beta"}) == streamFingerprint([]string{"alphab", "eta"}) {
		t.Fatal("the fingerprint must separate names")
	}
	for _, bad := range []string{"", "1", "1." + fp, "1." + fp + ".0.z", "2." + fp + ".0.z.1", "1." + fp + ".0.Z.1",
		"1." + fp + ".0.-1.1", "1." + fp + ".00.1.1", "1.00000000.0.1.1", "1." + fp + ".0.1." + strings.Repeat("z", 20)} {
		if _, err := parseStreamID(bad, fp, 3); err == nil {
			t.Errorf("parsed %q", bad)
		}
	}
}

// FuzzParseStreamID: a Last-Event-ID is whatever a client sends; parsing never panics, and
// what it accepts formats back to itself.
func FuzzParseStreamID(f *testing.F) {
	fp := streamFingerprint([]string{"p", "q"})
	f.Add("1." + fp + ".0.1")
	f.Add("1." + fp + ".zz.3w5e11264sgsf")
	f.Add("p:17")
	f.Fuzz(func(t *testing.T, id string) {
		pos, err := parseStreamID(id, fp, 2)
		if err != nil {
			return
		}
		if again := string(appendStreamID(nil, fp, pos)); again != id {
			t.Fatalf("%q parsed to %v, which formats as %q", id, pos, again)
		}
	})
}
