package main

import (
	"slices"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestBatchJobsDeleteEveryTaskOnceInAFixedRandomOrder: a prewrite deletes each task of each
// project exactly once, one project per transaction, in an order that is not the order of the
// task IDs and is the same in every run.
func TestBatchJobsDeleteEveryTaskOnceInAFixedRandomOrder(t *testing.T) {
	projects, counts := []string{"a", "b"}, []int{1000, 7}
	tasksOf := func(batches [][]deleteJob) map[string][]string {
		out := map[string][]string{}
		for _, b := range batches {
			require.NotEmpty(t, b)
			require.LessOrEqual(t, len(b), 50)
			for _, j := range b {
				require.Equal(t, b[0].project, j.project, "one project per transaction")
				out[j.project] = append(out[j.project], j.task)
			}
		}
		return out
	}
	got := tasksOf(batchJobs(projects, counts, "t", 50))
	require.Equal(t, got, tasksOf(batchJobs(projects, counts, "t", 50)), "the same order in every run")
	for p, project := range projects {
		var inIDOrder []string
		for k := 1; k <= counts[p]; k++ {
			inIDOrder = append(inIDOrder, "t-"+strconv.Itoa(k))
		}
		slices.Sort(inIDOrder)
		deleted := slices.Clone(got[project])
		slices.Sort(deleted)
		require.Equal(t, inIDOrder, deleted, "every task of %s once", project)
	}
	require.NotEqual(t, got["a"][:20], []string{"t-1", "t-2", "t-3", "t-4", "t-5", "t-6", "t-7", "t-8", "t-9", "t-10",
		"t-11", "t-12", "t-13", "t-14", "t-15", "t-16", "t-17", "t-18", "t-19", "t-20"}, "not in ID order")
}
