"""The admin console (`/console`): server-rendered pages over the turn log, the judge and the
weight versions. May import proxy modules; imports trainer only lazily, for a rollback."""
