"""What several test modules use, kept here so that no test module imports another (issue 39's tiers start here)."""
