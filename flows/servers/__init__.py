"""The servers a campaign reports to: `campaign ui` (Prefect + MLflow on loopback) and the
temporary Prefect API server a launch starts before it imports anything."""
