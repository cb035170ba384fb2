"""The HTTP load client (`easerve bench`) and its report."""
