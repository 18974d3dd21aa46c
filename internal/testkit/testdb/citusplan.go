package testdb

import (
	"context"
	"encoding/json"
	"testing"

	"github.com/tallymeter/tally/internal/pgdb"
)

// CitusTasks returns the task count of every distributed job in sql's plan
// on a Citus coordinator, in the order EXPLAIN lists them (a statement's
// subplans, each a job of its own, included). A hot statement's plan is one
// job of one task: []int{1}. sql is planned with args, as the application
// sends it; nothing runs (EXPLAIN without ANALYZE).
func CitusTasks(t testing.TB, db pgdb.Querier, sql string, args ...any) []int {
	t.Helper()
	var plan []any
	if err := db.QueryRow(context.Background(), "EXPLAIN (FORMAT JSON, COSTS OFF) "+sql, args...).Scan(&plan); err != nil {
		t.Fatalf("testdb: planning on Citus: %v", err)
	}
	var tasks []int
	var walk func(any)
	walk = func(n any) {
		switch v := n.(type) {
		case map[string]any:
			if q, ok := v["Distributed Query"].(map[string]any); ok {
				if job, ok := q["Job"].(map[string]any); ok {
					if c, ok := job["Task Count"].(float64); ok {
						tasks = append(tasks, int(c))
					}
				}
			}
			for k, sub := range v {
				if k == "Remote Plan" {
					continue // the worker's plan of a task: no distributed job
				}
				walk(sub)
			}
		case []any:
			for _, sub := range v {
				walk(sub)
			}
		}
	}
	walk(plan)
	if len(tasks) == 0 {
		b, _ := json.Marshal(plan)
		t.Fatalf("testdb: no distributed job in the plan (not a Citus table?): %s", b)
	}
	return tasks
}
