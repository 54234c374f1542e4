"""The project's one base exception.

A user's mistake (a bad spec, a request no node can hold, a corrupt checkpoint) raises a
subclass whose message names the culprit and the fix. `assert` is kept for internal
invariants only.
"""


class CampaignError(Exception):
    """Base of every error caused by input the user can fix."""
