"""Cross-cutting helpers of the platform (security)."""
