-- Re-scored vs original run per step: groups and samples kept, dropped (zero variance), gained, advantage sign flipped
-- Run it on a rescore folder (`rlpipe rescore`), where original_* are the run's own tables and
-- scores / groups / advantages the counterfactual ones:
--   rlpipe sql runs/demo/rl/rescore/NAME --query rescore_compare
-- Groups are counted at the step that decided them; rewards at the step that sampled them.
-- columns:
--   run_id                   run (its sample ids are the run's)
--   step                     training step
--   groups_trained           groups the run trained at this step
--   groups_kept              ... still trained with the new rewards
--   groups_dropped           ... dropped with the new rewards (zero variance, now or when carried)
--   groups_gained            groups the run dropped for zero variance that now have variance
--   samples_trained          samples the run trained at this step
--   samples_kept             ... still trained
--   samples_dropped          ... not trained any more
--   samples_flipped          kept samples whose advantage changed sign
--   samples_zeroed           kept samples whose advantage became 0 (was not)
--   reward_mean              mean original reward of the step's rollouts
--   reward_mean_rescored     mean new reward of the same rollouts
--   reward_errors_rescored   new reward calls that raised or timed out (scores.error)
with g as (
    select o.run_id, o.step, o.status as original, c.status as rescored
    from original_groups o
    left join groups c on c.run_id = o.run_id and c.step = o.step and c.group_id = o.group_id
),
groups_by_step as (
    select run_id, step,
           count(*) filter (where original = 'trained') as groups_trained,
           count(*) filter (where original = 'trained' and rescored = 'trained') as groups_kept,
           count(*) filter (where original = 'trained' and rescored is distinct from 'trained') as groups_dropped,
           count(*) filter (where original = 'zero_variance' and rescored = 'carried') as groups_gained
    from g group by run_id, step
),
a as (
    select o.run_id, o.step, o.advantage as original, c.advantage as rescored
    from original_advantages o
    left join advantages c on c.run_id = o.run_id and c.step = o.step and c.sample_id = o.sample_id
),
samples_by_step as (
    select run_id, step,
           count(*) as samples_trained,
           count(rescored) as samples_kept,
           count(*) - count(rescored) as samples_dropped,
           count(*) filter (where sign(original) * sign(rescored) < 0) as samples_flipped,
           count(*) filter (where original <> 0 and rescored = 0) as samples_zeroed
    from a group by run_id, step
),
rewards_by_step as (
    select o.run_id, o.step,
           avg(o.reward) as reward_mean,
           avg(c.reward) as reward_mean_rescored,
           count(c.error) as reward_errors_rescored
    from original_scores o
    join scores c on c.run_id = o.run_id and c.step = o.step and c.sample_id = o.sample_id
    group by o.run_id, o.step
)
select run_id, step,
       coalesce(groups_trained, 0) as groups_trained, coalesce(groups_kept, 0) as groups_kept,
       coalesce(groups_dropped, 0) as groups_dropped, coalesce(groups_gained, 0) as groups_gained,
       coalesce(samples_trained, 0) as samples_trained, coalesce(samples_kept, 0) as samples_kept,
       coalesce(samples_dropped, 0) as samples_dropped, coalesce(samples_flipped, 0) as samples_flipped,
       coalesce(samples_zeroed, 0) as samples_zeroed,
       reward_mean, reward_mean_rescored, coalesce(reward_errors_rescored, 0) as reward_errors_rescored
from groups_by_step
full join samples_by_step using (run_id, step)
full join rewards_by_step using (run_id, step)
order by run_id, step
