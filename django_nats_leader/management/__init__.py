"""Management commands of django_nats_leader."""
