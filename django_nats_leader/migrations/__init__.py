"""Migrations of django_nats_leader."""
