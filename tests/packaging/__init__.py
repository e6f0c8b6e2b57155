"""keel as a user installs it: the built wheel in a new virtualenv outside the checkout."""
