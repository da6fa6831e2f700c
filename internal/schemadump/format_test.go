package schemadump_test

import (
	"strings"
	"testing"

	"fusion/outbox/internal/schemadump"
)

// dumpFixture is a small plain pg_dump of the kind Format reads, with an entry of each sort.
const dumpFixture = `--
-- PostgreSQL database dump
--

\restrict abc123

-- Dumped from database version 15.18
-- Dumped by pg_dump version 15.18

SET statement_timeout = 0;
SELECT pg_catalog.set_config('search_path', '', false);

--
-- Name: d; Type: DOMAIN; Schema: public; Owner: -
--

CREATE DOMAIN public.d AS text;


--
-- Name: f(integer); Type: FUNCTION; Schema: public; Owner: -
--

CREATE FUNCTION public.f(p integer) RETURNS public.d
    LANGUAGE sql
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    AS $$ SELECT public.g() $$;


SET default_tablespace = '';

--
-- Name: t; Type: TABLE; Schema: public; Owner: -
--

CREATE TABLE public.t (
    a public.d NOT NULL
);


--
-- Name: t t_pkey; Type: CONSTRAINT; Schema: public; Owner: -
--

ALTER TABLE ONLY public.t
    ADD CONSTRAINT t_pkey PRIMARY KEY (a);


--
-- Name: t_a; Type: INDEX; Schema: public; Owner: -
--

CREATE INDEX t_a ON public.t USING btree (a);


--
-- Name: t; Type: ROW SECURITY; Schema: public; Owner: -
--

ALTER TABLE public.t ENABLE ROW LEVEL SECURITY;


--
-- Name: t p; Type: POLICY; Schema: public; Owner: -
--

CREATE POLICY p ON public.t USING (true);


--
-- Name: FUNCTION f(p integer); Type: ACL; Schema: public; Owner: -
--

REVOKE ALL ON FUNCTION public.f(p integer) FROM PUBLIC;
GRANT ALL ON FUNCTION public.f(p integer) TO alice;


--
-- Name: TABLE t; Type: ACL; Schema: public; Owner: -
--

GRANT SELECT ON TABLE public.t TO alice;


--
-- PostgreSQL database dump complete
--

\unrestrict abc123

`

func TestFormatSortsAndStrips(t *testing.T) {
	got, err := schemadump.Format(dumpFixture, schemadump.Options{Header: "head\n\nline", Schema: "public"})
	if err != nil {
		t.Fatal(err)
	}
	rule := "--" + strings.Repeat("-", 98)
	want := `-- head
--
-- line


` + rule + `
-- Types and domains
` + rule + `

CREATE DOMAIN d AS text;


` + rule + `
-- Tables, each with its identity column, keys, checks added later, foreign keys and indexes
` + rule + `

CREATE TABLE t (
    a d NOT NULL
);

ALTER TABLE ONLY t
    ADD CONSTRAINT t_pkey PRIMARY KEY (a);

CREATE INDEX t_a ON t USING btree (a);


` + rule + `
-- Functions, each with its settings (search_path, plan_cache_mode, ...) and what PUBLIC may do with it
` + rule + `

CREATE FUNCTION f(p integer) RETURNS d
    LANGUAGE sql
    SET search_path TO 'pg_catalog', 'public', 'pg_temp'
    AS $$ SELECT public.g() $$;

REVOKE ALL ON FUNCTION f(p integer) FROM PUBLIC;


` + rule + `
-- Row-level security: enabled per table (FORCE is in each CREATE TABLE's group above), then its policies
` + rule + `

ALTER TABLE t ENABLE ROW LEVEL SECURITY;

CREATE POLICY p ON t USING (true);
`
	if got != want {
		t.Fatalf("Format:\n%s\nwant:\n%s\n%s", got, want, diffSummary(want, got))
	}
}

func TestFormatRefusesWhatIsNotADump(t *testing.T) {
	if _, err := schemadump.Format("CREATE TABLE t ();\n", schemadump.Options{}); err == nil {
		t.Fatal("Format accepted text with no pg_dump entries")
	}
}
