"""The admin console (`/console`): server-rendered pages over the turn log, the judge and the
weight versions. Imports the base and proxy modules; a rollback runs `clawrl versions
rollback N` as a child process rather than importing the trainer."""
