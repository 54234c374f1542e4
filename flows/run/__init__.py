"""Running a campaign on one machine or a pool's head: the Prefect flow and its loop, the live trials,
the scheduler's view of them, what `launch` shows, the profile flow, and the warden that
cleans up after a killed launch."""
