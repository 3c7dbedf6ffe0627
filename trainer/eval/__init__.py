"""`clawrl eval`: measure that the whole loop learns, driving a real stack with simulated users.
May import proxy/ (stack, admin, db), trainer.world and itself; the trainer proper never
imports it."""
