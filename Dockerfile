# The operator image: slim Python, the operator extra only (no torch), non-root.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY runtime ./runtime
COPY kernels ./kernels
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
 && pip download --no-cache-dir --dest /wheels "pydantic==2.14.3" "PyYAML==6.0.3" \
    "kopf==1.45.2" "kubernetes==37.0.2" "prometheus-client==0.26.0"

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home holeblend
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links /wheels "holeblend[operator]" \
 && rm -rf /wheels
USER 10001
EXPOSE 8080
ENTRYPOINT ["holeblend-operator"]
CMD ["run"]
