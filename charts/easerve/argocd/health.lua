-- Argo CD health check for easerve.io/EPDDeployment (Lua 5.1, as Argo CD runs it).
-- Install: argocd-cm key `resource.customizations.health.easerve.io_EPDDeployment` (see
-- argocd-cm-values.yaml beside this file and docs/gitops.md).
--
-- The operator writes status.observedGeneration, status.phase and the conditions Ready,
-- Progressing, Degraded (human-facing) plus Reconciling and Stalled (kstatus semantics), each
-- with a reason. Rules, in order:
--   1. no status yet, or observedGeneration behind metadata.generation -> Progressing
--      (whatever the old conditions say, they describe an older spec)
--   2. Stalled=True or Degraded=True or phase Failed                    -> Degraded (reason: message)
--   3. Ready=True                                                       -> Healthy
--   4. Reconciling=True or Progressing=True, or anything else           -> Progressing
local hs = {}

local function condition(status, ctype)
  if status == nil or status.conditions == nil then
    return nil
  end
  for _, c in ipairs(status.conditions) do
    if c.type == ctype then
      return c
    end
  end
  return nil
end

local function is_true(c)
  return c ~= nil and c.status == "True"
end

local function describe(c, fallback)
  if c == nil then
    return fallback
  end
  local reason = c.reason or fallback
  if c.message ~= nil and c.message ~= "" then
    return reason .. ": " .. c.message
  end
  return reason
end

local status = obj.status
if status == nil then
  hs.status = "Progressing"
  hs.message = "Waiting for the operator to report status"
  return hs
end

local generation = obj.metadata and obj.metadata.generation
local observed = status.observedGeneration
if observed == nil or (generation ~= nil and observed < generation) then
  hs.status = "Progressing"
  if generation ~= nil then
    hs.message = "Waiting for the operator to observe generation " .. tostring(generation)
  else
    hs.message = "Waiting for the operator to observe the spec"
  end
  return hs
end

local stalled = condition(status, "Stalled")
local degraded = condition(status, "Degraded")
if is_true(stalled) then
  hs.status = "Degraded"
  hs.message = describe(stalled, "Stalled")
  return hs
end
if is_true(degraded) then
  hs.status = "Degraded"
  hs.message = describe(degraded, "Degraded")
  return hs
end
if status.phase == "Failed" then
  hs.status = "Degraded"
  hs.message = describe(condition(status, "Ready"), "Failed")
  return hs
end

local ready = condition(status, "Ready")
if is_true(ready) then
  hs.status = "Healthy"
  hs.message = describe(ready, "Ready")
  return hs
end

local reconciling = condition(status, "Reconciling")
local progressing = condition(status, "Progressing")
hs.status = "Progressing"
if is_true(reconciling) then
  hs.message = describe(reconciling, "Reconciling")
elseif is_true(progressing) then
  hs.message = describe(progressing, "Progressing")
else
  hs.message = describe(ready, "Waiting for the EPDDeployment to become ready")
end
return hs
