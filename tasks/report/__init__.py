"""The comparison report: report.json, its view, report.md and the charts (tasks/report/)."""
